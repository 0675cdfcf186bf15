"""The files and directories the stages hand each other, named here once: what one stage writes
is what a later one (or the report, or `prism run`) reads, so a name changes in one place.

A stage's own directory (``--out``) holds its figures (``summary.json`` of calibrate,
``emulate.json`` of emulate), the graph it writes (``graph/``), its launches' per-process logs
(``logs/``, with ``--tee``) and a sandbox run's rank logs and replay. ``prism run``'s directory
holds one directory per stage (``bare``, ``time``, ``cal``, ``emulate``), the run's options and
figures (``run.json``) and the report (``report.html``).
"""

LOGS_DIR = "logs"  # a stage's per-process logs of its launches (--tee); prism run's stage logs
RANKLOGS_DIR = "ranklogs"  # a sandbox run's rank logs (prismllm.trace.ranklog)
REPLAY_FILE = "replay.json"  # a sandbox run's first assistant's replay of the virtual ranks
# ... and with real timing its schedule of the calls with the sandbox, call by call (assistant.clock)
SCHEDULE_FILE = "schedule.parquet"
# ... and on the CPU the host time each sandbox rank left out of its clock, shared (comm.leftout)
LEFT_OUT_FILE = "left_out.bin"
GRAPH_DIR = "graph"  # the graph a stage writes in its directory (time; calibrate --write-graph)
SLICE_FILE = "slice.json"  # in a slice's directory (prism time): how its run ended, what it measured
LOAD_DIR = "load"  # prism time's compute-under-load pass (its own slices and graph)
SUMMARY_FILE = "summary.json"  # calibrate's figures
EMULATE_FILE = "emulate.json"  # emulate's figures
# prism run's directory
BARE_DIR, TIME_DIR, CAL_DIR, EMULATE_DIR = "bare", "time", "cal", "emulate"
RUN_FILE = "run.json"
REPORT_FILE = "report.html"

__all__ = [
    "BARE_DIR",
    "CAL_DIR",
    "EMULATE_DIR",
    "EMULATE_FILE",
    "GRAPH_DIR",
    "LEFT_OUT_FILE",
    "LOAD_DIR",
    "LOGS_DIR",
    "RANKLOGS_DIR",
    "REPLAY_FILE",
    "REPORT_FILE",
    "RUN_FILE",
    "SCHEDULE_FILE",
    "SLICE_FILE",
    "SUMMARY_FILE",
    "TIME_DIR",
]
