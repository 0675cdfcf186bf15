"""torchtitan's own entry (``python -m torchtitan.train``) as a script path, for launchers that
run a file (``prism record ... -- examples/torchtitan/train.py ARGS``); sys.argv passes through.

``torch213_compat`` bridges two torchtitan 0.3.0 / torch 2.13.0 API differences (unrelated to
prism; see that file). Nothing else: torchtitan's ``main`` runs as it is.
"""

import torch213_compat

torch213_compat.install()

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
