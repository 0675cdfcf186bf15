"""Small local assets for torchtitan's debug configs, made offline and deterministically.

    python examples/torchtitan/make_assets.py [DIR]      (default: out/torchtitan/assets)

writes
    DIR/tokenizer/tokenizer.json, tokenizer_config.json   a byte-level BPE tokenizer trained
        here (vocabulary < 2048, the debugmodel's vocab_size) with <|begin_of_text|> and
        <|end_of_text|> as BOS/EOS, as torchtitan's HuggingFaceTokenizer reads them
    DIR/c4_test/data.json   JSON lines {"text": ...}, the layout of torchtitan's c4_test set
        (``load_dataset(path, split="train")`` on a local folder)

No download: the text is pseudo-English sampled from a fixed word list with a fixed seed, and the
same command writes the same bytes. ``prism_configs.py`` reads DIR's default; for another DIR,
pass ``--hf-assets-path DIR/tokenizer --dataloader.dataset-path DIR/c4_test`` to the training.
"""

from __future__ import annotations

import argparse
import json
import os
import random

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which "
    "be are were have has had not but or an one all their there been would who will more "
    "when what about into than some could them other its time only new two first over "
    "after also most made where many through before these such years people while state "
    "train model token layer tensor device gradient rank group shard pipeline stage batch "
    "memory compute network graph node edge river mountain city village market winter "
    "summer autumn spring morning evening light water stone garden music window teacher "
    "student letter number season history science language forest island ocean bridge "
    "north south east west small large quiet bright early later simple careful"
).split()

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def sentences(rng: random.Random, n: int):
    for _ in range(n):
        k = rng.randint(5, 16)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        yield s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"])


# the default directory: under out/, which the repository ignores
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "out", "torchtitan", "assets")


def main() -> None:
    ap = argparse.ArgumentParser(description="Write torchtitan's small local assets (tokenizer, c4_test-like set).")
    ap.add_argument("out", nargs="?", default=os.path.normpath(DEFAULT_DIR), help="the directory to write")
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=2000)
    a = ap.parse_args()

    rng = random.Random(1234)
    docs = [" ".join(sentences(rng, rng.randint(4, 12))) for _ in range(a.docs)]

    ds_dir = os.path.join(a.out, "c4_test")
    os.makedirs(ds_dir, exist_ok=True)
    with open(os.path.join(ds_dir, "data.json"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tk_dir = os.path.join(a.out, "tokenizer")
    os.makedirs(tk_dir, exist_ok=True)
    tok.save(os.path.join(tk_dir, "tokenizer.json"))
    with open(os.path.join(tk_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 131072,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
            indent=1,
        )
    size = sum(os.path.getsize(os.path.join(d, n)) for d in (ds_dir, tk_dir) for n in os.listdir(d))
    print(f"wrote {a.out}: {len(docs)} documents, vocab {tok.get_vocab_size()}, {size} bytes")


if __name__ == "__main__":
    main()
