"""Two processes as two TP ranks (a gloo process group, as SGLang's TP workers have one) over one
store, on the linker path: real UnifiedRadixCache + TuttiLinker per rank, same directories.

MHA: each rank holds its own heads, so both write the same token sequence with different bytes and
each restores exactly its own (no cross-talk). MLA: the latent KV is the same on every rank; rank 0
writes, rank 1 writes nothing and restores rank 0's pages byte for byte.
"""

import multiprocessing as mp
import socket

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # spawned ranks import SGLang (about 10 s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, dirs: list, mla: bool, q, fp8: bool = False) -> None:
    try:
        import torch
        import torch.distributed as dist

        from tutti_hicache.testing import sglang as h
        h.ensure_sglang()
        from tutti_hicache.testing.linker_rig import Rig
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        toks = list(range(100, 124))  # 6 pages
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        a = Rig(dirs, mla=mla, dtype=dtype)
        slots = a.fill(len(toks), seed=0 if mla else 1 + rank)  # MLA: the same latent on both ranks
        want = a.snapshot(slots)
        a.insert(toks, slots)
        writer = a.linker.kv.writer
        a.commit_offloads(1)
        written = a.linker.store.stats()["write_pages"]
        dist.barrier()  # both ranks' offloads are on disk
        a.close()
        b = Rig(dirs, mla=mla, dtype=dtype)  # a restart of the rank over the same directories
        hit, failed = b.restore(toks)
        exact = bool(b.loads) and all(torch.equal(x, y) for x, y in zip(b.snapshot(b.loads[-1]), want))
        ident = b.linker.store.identity
        b.close()
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, dict(writer=writer, written=written, hit=hit, failed=len(failed), exact=exact,
                          tp=ident.get("tp"), dtype=ident.get("dtype"))))
    except BaseException as e:  # report instead of leaving the parent waiting
        q.put((rank, repr(e)))
        raise


def _run_ranks(tmp_path, mla: bool, fp8: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, [str(tmp_path)], mla, q, fp8)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for r, res in out.items():
        assert isinstance(res, dict), f"rank {r}: {res}"
    return out


def test_mha_tp_ranks_restore_their_own_heads(sglang, tmp_path):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    out = _run_ranks(tmp_path, mla=False)
    for r in (0, 1):
        assert out[r]["writer"] and out[r]["written"] == 6
        assert out[r]["hit"] == 24 and out[r]["failed"] == 0
        assert out[r]["exact"], f"rank {r} restored bytes that are not its own"
        assert out[r]["tp"] == [r, 2]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_e4m3"])
def test_mla_rank0_writes_rank1_reads(sglang, tmp_path, fp8):
    if sglang.sglang_version() < "0.5.23":
        pytest.skip("the UnifiedCacheLinker path needs SGLang 0.5.23")
    out = _run_ranks(tmp_path, mla=True, fp8=fp8)
    assert out[0]["dtype"] == out[1]["dtype"] == ("float8_e4m3fn" if fp8 else "bfloat16")
    assert out[0]["writer"] and out[0]["written"] == 6
    assert not out[1]["writer"] and out[1]["written"] == 0
    for r in (0, 1):
        assert out[r]["hit"] == 24 and out[r]["failed"] == 0 and out[r]["exact"]
