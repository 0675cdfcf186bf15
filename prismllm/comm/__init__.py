"""Interception layer: the "prism" c10d backend and the recording process group.

``prismllm.comm.bootstrap`` runs a program under it; ``prismllm.comm.install`` installs it;
``prismllm.comm.recording`` holds the ProcessGroup/Work wrappers and
``prismllm.comm.recorder`` the per-rank node bookkeeping. Importing this package imports
nothing heavy (no torch)."""
