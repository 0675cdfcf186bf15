"""capture: run a training program's ranks and record what they execute.

``record.py`` is ``prism record`` (every rank real, the recording backend); ``solo.py`` is
``prism capture`` (the bare graph of N ranks from a few run alone); ``common.py`` what both share
(spool, output directory, devices, manifest). Import from the modules: the package's names are
theirs (``prismllm.capture.record`` is a module, not its function ``record``)."""
