"""torchtitan's own entry (``python -m torchtitan.train``) as a script path, for launchers that
run a file (``prism record ... -- examples/torchtitan/train.py ARGS``); sys.argv passes through.

``torch_compat`` bridges the API differences between torchtitan 0.3.0 and torch 2.11.0 / 2.13.0
(unrelated to prism; see that file). Nothing else: torchtitan's ``main`` runs as it is.
"""

import torch_compat

torch_compat.install()

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
