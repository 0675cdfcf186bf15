"""The allocator-history comparison used to explain peak-memory differences (GPU runs write
the histories; the analysis is plain Python, tested here)."""

from prismllm.comm.memhistory import diff_at_peak, live_at_peak, site


def ev(action, addr, size, where=("/w/prog.py", 1, "f")):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [where]}


def test_peak_counts_alloc_until_free_requested():
    events = [
        ev("alloc", 1, 10),
        ev("alloc", 2, 4),
        ev("free_requested", 2, 4),
        ev("free_completed", 2, 4),
        ev("alloc", 3, 2),
    ]
    peak, live = live_at_peak(events)
    assert peak == 14 and sorted(b["addr"] for b in live) == [1, 2]


def test_diff_names_the_extra_blocks_and_their_site():
    torch_frame = ("/site-packages/torch/nn/functional.py", 7, "linear")
    base = [ev("alloc", 1, 8), ev("alloc", 2, 4, ("/w/prog.py", 30, "recv"))]
    extra = base + [ev("alloc", 3, 4, ("/w/prog.py", 30, "recv"))]
    d = diff_at_peak(extra, base)
    assert d["peak_a"] == 16 and d["peak_b"] == 12
    assert d["only_a"] == [[4, "prog.py:30:recv", 1]] and d["only_b"] == []
    # torch's own frames are skipped when naming the site
    assert site({"frames": [torch_frame, ("/w/prog.py", 9, "mlp")]}) == "prog.py:9:mlp"
