"""Bad input gets one clear line naming the key, file or flag and what to do, never a traceback:
the CLI (missing or empty store directories, cost without a throughput or with nonsense, a
missing optional dependency, help text on every option) and the config (a malformed tutti_dirs
JSON, a misspelt key). The store's side (capacity and segments against the filesystem) is in
tests/store/test_fit.py, the benchmark's media in tests/sglang/test_cli.py."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from tutti_hicache import cli
from tutti_hicache.config import TuttiConfig
from tutti_hicache.prefetch import cuts


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("cmd", ["inspect", "fsck"])
def test_a_missing_directory_is_one_line(tmp_path, capsys, cmd):
    rc, out, err = run_cli(capsys, cmd, str(tmp_path / "nope"))
    assert rc == 2 and out == ""
    assert err == (f"tutti-hicache {cmd}: {tmp_path / 'nope'}: no such directory (give the store "
                   "directories, tutti_dirs)\n")


@pytest.mark.parametrize("cmd", ["inspect", "fsck"])
def test_an_empty_directory_says_there_is_no_store(tmp_path, capsys, cmd):
    rc, out, err = run_cli(capsys, cmd, str(tmp_path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"tutti-hicache {cmd}: no tutti store in {tmp_path} ")


def test_cost_needs_a_measured_throughput(capsys):
    rc, out, err = run_cli(capsys, "cost")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--throughput TOKENS_PER_S" in err and "--from-json" in err


@pytest.mark.parametrize("args, flag, why", [
    (["--throughput", "-5"], "--throughput", "must be > 0, got -5"),
    (["--throughput", "0"], "--throughput", "must be > 0, got 0"),
    (["--throughput", "nan"], "--throughput", "must be > 0, got nan"),
    (["--throughput", "lots"], "--throughput", "expected a number, got 'lots'"),
    (["--throughput", "10", "--gpus", "0"], "--gpus", "must be > 0, got 0"),
    (["--throughput", "10", "--p-gpu", "-1"], "--p-gpu", "must be >= 0, got -1"),
    (["--throughput", "10", "--ssd-dwpd", "0"], "--ssd-dwpd", "must be > 0, got 0"),
    (["--throughput", "10", "--write-amplification", "0.5"], "--write-amplification",
     "must be >= 1, got 0.5"),
])
def test_cost_refuses_nonsense_in_one_line(capsys, args, flag, why):
    with pytest.raises(SystemExit) as e:
        cli.main(["cost", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err == f"tutti-hicache cost: argument {flag}: {why} (see tutti-hicache cost --help)\n"


def test_cost_states_what_it_assumed(capsys):
    rc, out, _ = run_cli(capsys, "cost", "--throughput", "2000", "--dram-gb", "40")
    assert rc == 0
    assert out.splitlines()[0] == ("assumed: $5/h per GPU (--p-gpu) x 1 GPU(s) (--gpus), "
                                   "$0.0088/GB-h DRAM (--p-mem), $8.2e-05/GB-h SSD (--p-ssd), "
                                   "40 GB DRAM (--dram-gb), 0 GB SSD (--ssd-gb)")
    per_hour = 5.0 + 0.0088 * 40
    assert f"{per_hour / (2000 * 3600) * 1e6:.4f}" in out.splitlines()[-1]


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {a}", h) for a, h in _actions(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield "/".join(action.option_strings) or action.dest, action.help


def test_every_cli_option_has_help_text():
    actions = list(_actions(cli.parser()))
    assert len(actions) > 40
    assert [name for name, text in actions if not text] == []


def test_a_malformed_tutti_dirs_names_the_key_and_the_fix():
    with pytest.raises(ValueError) as e:
        TuttiConfig.from_sources({"tutti_dirs": '["/a",'}, env={})
    msg = str(e.value)
    assert msg.startswith("tutti_dirs: not a valid JSON list (Expecting value at character 6) "
                          "in '[\"/a\",'")
    assert '["/nvme0/kv", "/nvme1/kv"]' in msg
    with pytest.raises(ValueError, match=r"^TUTTI_HICACHE_DIRS: not a valid JSON list"):
        TuttiConfig.from_sources({}, env={"TUTTI_HICACHE_DIRS": "[/a, /b]"})


@pytest.mark.parametrize("typo, meant", [("tutti_capicity_gb", "tutti_capacity_gb"),
                                         ("tutti_dir", "tutti_dirs"),
                                         ("tutti_segment_size_gb", "tutti_segment_gb"),
                                         ("tutti_verfy", "tutti_verify")])
def test_a_misspelt_key_gets_a_suggestion(typo, meant):
    with pytest.raises(ValueError) as e:
        TuttiConfig.from_sources({typo: 1}, env={})
    assert str(e.value) == f"{typo}: unknown tutti setting; did you mean {meant}?"


def test_an_unknown_key_without_a_near_one_lists_the_keys():
    with pytest.raises(ValueError, match=r"tutti_zzz: unknown tutti setting \(known: .*"
                                         r"tutti_capacity_gb, .*tutti_dirs, "):
        TuttiConfig.from_sources({"tutti_zzz": 1}, env={})


# A subprocess where `import sglang` / `import torch` fail as on a machine without them.
_WITHOUT = textwrap.dedent("""
    import importlib.abc, importlib.metadata as md, sys
    BLOCKED = set(sys.argv[1].split(","))
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
    real = md.version
    def version(name):
        if name in BLOCKED:
            raise md.PackageNotFoundError(name)
        return real(name)
    md.version = version
    from tutti_hicache.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def without(blocked: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT, blocked, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("args", [["demo", "--pages", "2"],
                                  ["bench", "store", "--medium", "MEDIUM", "--pages", "2"]])
def test_demo_and_bench_without_sglang_name_the_install(tmp_path, args):
    args = [str(tmp_path) if a == "MEDIUM" else a for a in args]
    r = without("sglang,torch", *args, *(["--dir", str(tmp_path)] if args[0] == "demo" else []))
    cmd = "tutti-hicache " + " ".join(args[:2] if args[0] == "bench" else args[:1])
    assert r.returncode == 2 and r.stdout.count("tutti demo") <= 1
    assert r.stderr == (f"{cmd}: SGLang is not installed; install SGLang 0.5.17-0.5.23 with its "
                        "dependencies: pip install 'tutti-hicache[sglang]' (or pip install "
                        "'sglang==0.5.23')\n")
    assert list(tmp_path.iterdir()) == []


def test_profile_without_torch_names_the_install(tmp_path):
    r = without("torch", "profile", "--out", str(tmp_path / "s.json"), "--quick")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("tutti-hicache profile: needs PyTorch: pip install torch (a CUDA build to "
                        "profile a GPU) (No module named 'torch')\n")


# ------------------------------------------------ what SGLang's settings cut (prefetch.cuts)
DEFAULTS = {"prefetch_policy": "wait_complete", "host_memory_mode": "cache", "hicache_size": 0,
            "hicache_ratio": None, "context_length": 0, "timeout_base_s": 1.0,
            "timeout_per_ki_s": 0.25}


def test_nothing_to_say_for_wait_complete_and_a_host_pool_twice_the_gpus():
    assert cuts(DEFAULTS, 2_000_000, 1_000_000, 131072) == []


def test_a_host_pool_without_room_beside_the_gpus_pages_is_named_with_the_size_it_needs():
    s = dict(DEFAULTS, hicache_size=12, context_length=32768)
    [msg] = cuts(s, 91552, 800_000, 131072)
    assert msg.startswith("the host pool (--hicache-size 12: 91552 tokens) is smaller than the "
                          "GPU's KV pool (800000 tokens) plus one 32768-token context")
    assert f"at least {-(-(800_000 + 32768) * 131072 // 10**9)}," in msg
    assert cuts(s, 900_000, 800_000, 131072) == []  # room for one context beside the GPU's
    assert cuts(dict(s, host_memory_mode="buffer_only"), 91552, 800_000, 131072) == []


def test_the_prefetch_policies_that_cut_hits():
    [best] = cuts(dict(DEFAULTS, prefetch_policy="best_effort"), 2, 1, 1)
    assert best.startswith("--hicache-storage-prefetch-policy best_effort") and "wait_complete" in best
    [timeout] = cuts(dict(DEFAULTS, prefetch_policy="timeout", timeout_base_s=2.0), 2, 1, 1)
    assert "within 2 s + 0.25 s per 1024 tokens" in timeout and "use wait_complete" in timeout


def test_inspect_keys_refuses_a_negative_count(capsys):
    """--keys -1 listed every key but one (a Python slice); 0 lists none."""
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "--keys", "-1", "."])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == "tutti-hicache inspect: argument --keys: must be >= 0, got -1 (see tutti-hicache inspect --help)\n"
