"""bench/results/README.md indexes every JSON kept there, and names no file that is not there: a
figure in the docs can always be traced to its raw file and the command that made it."""

import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"


def test_every_result_json_has_a_row_and_every_row_a_file():
    index = (RESULTS / "README.md").read_text()
    named = set(re.findall(r"^\| `([^`]+\.json)` \|", index, re.M))
    kept = {p.name for p in RESULTS.glob("*.json")}
    assert not kept - named, f"add a row to bench/results/README.md for: {sorted(kept - named)}"
    assert not named - kept, f"rows name files that are not there: {sorted(named - kept)}"
