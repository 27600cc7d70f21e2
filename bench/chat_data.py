"""Synthetic chat records at scale, for the data-preparation benchmark (bench/data_prep.py).

    python -m bench.chat_data OUT.jsonl --records 100000

Each record is {"messages": [...]}: a system turn in one record of five, then one to three user /
assistant exchanges (questions of 10-60 words, answers of 20-200 words) drawn from a fixed word list
with a seeded generator, so the same arguments always write the same bytes. With `--bad N`, N records
spread over the file are malformed (a missing role, a non-list `messages`, a non-text content).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("the of and to in is was that for on with as by at from it an be this which or are have had not "
         "but what all were when we there can more if will one about up out do their time so some her would "
         "make like him into has two see could no way than been call who its now find long down day did get "
         "come made may part river stone lantern harbour garden library village market museum compass kite "
         "teapot violin owl fox heron otter sparrow golden quiet bright curious ancient careful gentle swift "
         "measure repair borrow describe explain compare remember travel build answer question").split()


def conversation(rng: random.Random) -> list[dict]:
    def text(low: int, high: int) -> str:
        words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
        return " ".join(words).capitalize() + rng.choice(".?!")

    messages = [{"role": "system", "content": text(5, 20)}] if rng.random() < 0.2 else []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        messages += [{"role": "user", "content": text(10, 60)}, {"role": "assistant", "content": text(20, 200)}]
    return messages


def write_chat_records(path: Path, records: int, seed: int = 0, bad: int = 0) -> Path:
    rng = random.Random(seed)
    bad_at = set(range(records // (bad + 1), records, records // (bad + 1))) if bad else set()
    with open(path, "w", encoding="utf-8") as out:
        for index in range(records):
            row: dict = {"messages": conversation(rng)}
            if index in bad_at:
                row = [{"messages": "not a list"}, {"messages": [{"content": "no role"}]},
                       {"messages": [{"role": "user", "content": 7}]}][index % 3]
            out.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bad", type=int, default=0, help="malformed records spread over the file")
    args = parser.parse_args()
    write_chat_records(args.out, args.records, args.seed, args.bad)
    print(f"{args.out}: {args.records} records, {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
