"""1,000 streaming clients dropping at random points (tests/test_disconnects.py runs 200).

    python scripts/disconnect_storm.py [--clients 1000] [--seed 0] [--json out.json]

Builds a tiny random checkpoint (as the tests do), serves it with a small device pool, a
CPU and an SSD tier, and runs the storm of tests/disconnect_storm.py: clients drop while
queued, mid-prefill, mid-decode, preempted, or after their prompt pages were loaded from a
tier. Checks that within 1 s of the last client the engine is idle and holds no page, and
that every client that stayed got exactly the offline API's text. Exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from checkpoints import build_checkpoint, build_tokenizer
from disconnect_storm import storm, storm_llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread-s", type=float, default=10.0, help="arrivals spread (s)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint("llama-gqa4-tied", Path(tmp) / "model")
        build_tokenizer(model)
        with storm_llm(model, Path(tmp) / "ssd") as llm:
            result = storm(llm, args.clients, args.seed, args.spread_s)
    summary = result.summary()
    ok = result.idle_after_s < 1.0 and not result.mismatches and summary["errors"] == 0
    summary["ok"] = ok
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
