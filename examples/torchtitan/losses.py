"""Print the full-precision loss and grad_norm per step that torchtitan logged to TensorBoard
(``--metrics.enable-tensorboard --metrics.save-for-all-ranks``), one line per rank:

    python examples/torchtitan/losses.py DUMP_FOLDER [RANK ...]

(torchtitan's console line rounds the loss to 5 decimals; this compares runs exactly.)
"""

import glob
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def main() -> None:
    dump, ranks = sys.argv[1], sys.argv[2:]
    for d in sorted(glob.glob(os.path.join(dump, "tb", "*", "rank_*"))):
        r = d.rsplit("_", 1)[-1]
        if ranks and r not in ranks:
            continue
        s = scalars(d)
        loss = next((v for k, v in s.items() if k.startswith("loss_metrics/global_avg_loss")), [])
        gn = next((v for k, v in s.items() if k.startswith("grad_norm")), [])
        print(f"rank {r}: loss {[repr(v) for _, v in loss]} grad_norm {[repr(v) for _, v in gn]}")


if __name__ == "__main__":
    main()
