"""Engram tables in host memory (trainer/engram_host.py) against GPU-resident tables: the same
training steps at one and two ranks (gloo), resume from the shards, and the sharded Sinkhorn."""
import dataclasses
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from conf.model import TinyModelConfig
from conf.optim import MuonConfig

VOCAB, SEQ, MICRO = 96, 32, 2
# a low clip so that clipping acts in every step (its factor then reaches the table rows too)
CLIP = 0.05


def tiny_model():
    from trainer.pretrain import assemble_model

    torch.manual_seed(0)
    cfg = dataclasses.replace(TinyModelConfig(), vocab_size=VOCAB, engram_min_rows=300)
    model, _ = assemble_model(cfg)
    return model


def batches(rank: int, steps: int, accum: int = 2):
    """[steps][ACCUM] micro-batches of this rank: ids with repeated n-grams (rows shared within and
    across micro-batches and ranks) and two documents per row."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            ids = torch.randint(0, 12, (MICRO, SEQ + 1), generator=g)
            docs = (torch.arange(SEQ) >= SEQ // 2).int().expand(MICRO, SEQ)
            step.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": docs})
        out.append(step)
    return out


class Run:
    """The trainer's step with its own optimiser path (reduce, clip, composite step), on a plain
    model: GPU-resident tables (`host=False`) or host tables."""

    def __init__(self, host: bool, rank: int = 0, world: int = 1, steps: int = 4, device: str = "cpu",
                 threads: int = 0):
        from optim import build_optimizer, lr_multiplier
        from trainer.engram_host import HostEngramTables
        from trainer.parallelize import build_layout

        self.cfg = MuonConfig(lr=1e-2, warmup_steps=2)
        self.device = torch.device(device)
        self.model = tiny_model().to(self.device)
        self.layout = build_layout(rank, world, 1, self.model.cfg.n_routed_experts)
        self.host = (HostEngramTables(self.model, self.cfg, rank, world, self.device, threads=threads)
                     if host else None)
        self.opt = build_optimizer(self.model, self.cfg, zero_stage=0, rank=rank, world_size=world)
        self.opt.enable_sparse_table_grads(self.model)
        self.lr = lr_multiplier(self.cfg, steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.lr)
        self.losses = []

    def step(self, micro_batches) -> None:
        from trainer.parallelize import clip_grad_norm, reduce_gradients

        if self.host is not None:
            self.host.prefetch([(b["input_ids"], b["doc_ids"]) for b in micro_batches])
        for b in micro_batches:
            b = {k: v.to(self.device) for k, v in b.items()}
            out = self.model(b["input_ids"], labels=b["labels"], doc_ids=b["doc_ids"])
            (out.loss / len(micro_batches)).backward()
            self.losses.append(out.loss.item())
        if self.host is not None:
            self.host.reduce_gradients()
        reduce_gradients(self.model, self.layout, set())
        clip_grad_norm(self.model, self.layout, set(), CLIP, external=self.host)
        multiplier = self.lr(self.sched.last_epoch)
        self.opt.step()
        if self.host is not None:
            self.host.step(multiplier)
        self.opt.zero_grad()
        self.sched.step()

    def tables(self) -> dict[int, torch.Tensor]:
        """layer -> this rank's view of the table: the whole table (GPU) or its own shard (host)."""
        if self.host is None:
            return {int(k): e.table.weight.detach().to("cpu", copy=True)
                    for k, e in self.model.engrams.items()}
        self.host.synchronize()
        return {layer: s.weight.clone() for layer, s in self.host.shards.items()}

    def momentum(self) -> dict[int, torch.Tensor]:
        if self.host is None:
            inner = self.opt.optimizers["sinkhorn"]
            return {int(k): inner.state[e.table.weight]["momentum_buffer"].to("cpu", copy=True)
                    for k, e in self.model.engrams.items()}
        self.host.synchronize()
        return {layer: s.momentum.clone() for layer, s in self.host.shards.items()}

    def dense(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()
                if ".table." not in n}


# Tolerances of "the same to fp32 rounding": a GPU table's sparse gradient sums a row's lookups in
# coalesce order, the host path in the embedding backward's order and then over micro-batches, so
# single rows differ in the last bits; Sinkhorn's row normalisation and Muon carry that on.
RTOL, ATOL = 1e-4, 1e-5
# On a GPU both runs also add in the device's reduction orders (atomics in the embedding backward
# and the sparse gradient's coalesce, which vary from run to run), and later steps carry that on
# through the optimisers' normalised steps, as at two ranks
TOLERANCES = {"cpu": (RTOL, ATOL), "cuda": (1e-3, 1e-4)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cuda: the streams, events and copies


@pytest.fixture(autouse=True)
def muon_in_fp32(monkeypatch):
    """Muon's Newton-Schulz in fp32 on every device (on CUDA it defaults to bf16). In bf16 a clip
    factor or gradient that differs in its last bits flips some iterates' roundings (2^-9 relative),
    the dense weights then differ by ~1e-3 of a step, and within three or four steps so do the
    losses (1e-4) and, through Sinkhorn's per-row normalisation of rows with small gradients, a few
    table rows by most of an update: two different runs, not fp32 rounding of one."""
    import functools

    import optim.muon

    monkeypatch.setattr(optim.muon, "newton_schulz",
                        functools.partial(optim.muon.newton_schulz, compute_dtype=torch.float32))


# one micro-batch a step adds little to two (slow tier only)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_host_tables_match_gpu_tables_at_one_rank(accum, device):
    """Four steps, clipping on: every weight, the tables and their momentum equal the GPU-table
    run's to fp32 rounding, and so do the losses."""
    rtol, atol = TOLERANCES[device]
    data = batches(0, 4, accum)
    gpu, host = Run(host=False, device=device), Run(host=True, device=device)
    for step in data:
        gpu.step(step)
        host.step(step)
    torch.testing.assert_close(torch.tensor(gpu.losses), torch.tensor(host.losses), rtol=rtol / 100,
                               atol=atol / 10)
    for layer, table in gpu.tables().items():
        torch.testing.assert_close(host.tables()[layer], table, rtol=rtol, atol=atol)
        torch.testing.assert_close(host.momentum()[layer], gpu.momentum()[layer], rtol=rtol, atol=atol)
        moved = (table != tiny_model().engrams[str(layer)].table.weight).any(1).sum()
        assert moved > 100, moved
    for name, p in gpu.dense().items():
        torch.testing.assert_close(host.dense()[name], p, rtol=rtol, atol=atol)
    host.host.close()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_updated_in_a_step_reach_the_next_step_before_their_write_back(device):
    """The writer thread held up so that step 2's rows are still not in the shards when step 3
    fetches: step 3's forward reads step 2's update all the same (copied over from the update's
    rows), so three steps equal the GPU-table run's; a fetch that needs the held write-back (step
    4's, which reads the shards for step 2's rows) waits for it and, past its deadline, says so."""
    import threading

    rtol, atol = TOLERANCES[device]
    data = batches(0, 4)
    gpu, host = Run(host=False, device=device), Run(host=True, device=device)
    tables = host.host
    for step in data[:1]:
        gpu.step(step)
        host.step(step)
    tables.synchronize()
    after_one = {layer: s.weight.clone() for layer, s in tables.shards.items()}
    gate = threading.Event()
    tables.writer.submit(gate.wait, 120)  # step 2's and 3's write-backs queue behind this
    for step in data[1:3]:
        gpu.step(step)
        host.step(step)
    assert not tables.written.done()
    for layer, s in tables.shards.items():  # still step 1's rows: step 3 could not read step 2's from here
        assert torch.equal(s.weight, after_one[layer]), layer
    touched = {layer: (gpu.tables()[layer] != after_one[layer]).any(1).sum() for layer in after_one}
    assert all(n > 100 for n in touched.values()), touched
    tables.timeout_s = 1.0
    tables.prefetch([(b["input_ids"], b["doc_ids"]) for b in data[3]])
    fetch, _ = tables.queued[True, tables.layers[0]][0]
    error = fetch.chunks[0].exception(timeout=60)
    assert isinstance(error, RuntimeError) and "write-back of the update before the last one" in str(error)
    tables.timeout_s = 60.0
    gate.set()
    for layer, table in gpu.tables().items():
        torch.testing.assert_close(host.tables()[layer], table, rtol=rtol, atol=atol)
        torch.testing.assert_close(host.momentum()[layer], gpu.momentum()[layer], rtol=rtol, atol=atol)
    for name, p in gpu.dense().items():
        torch.testing.assert_close(host.dense()[name], p, rtol=rtol, atol=atol)
    tables.close()


def test_host_table_resume_is_exact(tmp_path):
    from model.engram import engram_table_primes

    """Two steps, the shards and optimiser state saved, a fresh run loads them and takes two more:
    the tables, momentum and weights equal those of four uninterrupted steps, bit for bit."""
    data = batches(0, 4)
    straight = Run(host=True)
    for step in data:
        straight.step(step)
    first = Run(host=True)
    for step in data[:2]:
        first.step(step)
    first.host.save(tmp_path)
    saved = {"model": {k: v.clone() for k, v in first.model.state_dict().items()},
             "opt": first.opt.state_dict(), "sched": first.sched.state_dict()}
    rows = {layer: sum(p) for layer, p in engram_table_primes(first.model.cfg).items()}
    files = sorted(p.name for p in (tmp_path / "engram_host").iterdir())
    assert files == [f"layer{layer:02d}_rows{0:012d}-{n:012d}.safetensors"
                     for layer, n in sorted(rows.items())]
    second = Run(host=True)
    second.model.load_state_dict(saved["model"])
    second.opt.load_state_dict(saved["opt"])
    second.sched.load_state_dict(saved["sched"])
    second.host.load(tmp_path)
    for group in second.opt.param_groups:  # as the trainer's resume does: LambdaLR restores no lr
        group["lr"] = group["initial_lr"] * second.lr(second.sched.last_epoch)
    for step in data[2:]:
        second.step(step)
    for layer, table in straight.tables().items():
        assert torch.equal(table, second.tables()[layer]), layer
        assert torch.equal(straight.momentum()[layer], second.momentum()[layer]), layer
    for name, p in straight.dense().items():
        assert torch.equal(p, second.dense()[name]), name
    for run in (straight, first, second):
        run.host.close()


def _snapshot(gpu: Run, host: Run) -> dict:
    host.host.synchronize()  # the last update runs on the worker thread
    shards = {layer: (s.lo, s.hi, s.weight.clone(), s.momentum.clone())
              for layer, s in host.host.shards.items()}
    return {"gpu_tables": gpu.tables(), "gpu_momentum": gpu.momentum(), "shards": shards,
            "gpu_dense": gpu.dense(), "host_dense": host.dense()}


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    data = batches(rank, 3)
    gpu, host = Run(host=False, rank=rank, world=2, steps=3), Run(host=True, rank=rank, world=2, steps=3)
    snapshots = []
    for step in data:
        gpu.step(step)
        host.step(step)
        snapshots.append(_snapshot(gpu, host))
    torch.save({"snapshots": snapshots, "gpu_losses": gpu.losses, "host_losses": host.losses},
               f"{out}.{rank}")
    host.host.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_host_tables_match_gpu_tables_at_two_ranks(tmp_path):
    """Two ranks (gloo), each with its own data, three steps: each rank's shard holds the rows the
    GPU-table run's whole table holds there (to fp32 rounding: the owners add the ranks' gradients in
    another order), with the sharded Sinkhorn's column norms over both shards."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    port = _free_port()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r in results:
        torch.testing.assert_close(r["gpu_losses"], r["host_losses"], rtol=1e-6, atol=1e-6)
        # after the first step: the dense weights bit for bit, the tables to fp32 rounding; later
        # steps carry that rounding on through AdamW's normalised steps on the gate weights
        for i, (rtol, atol) in enumerate([(1e-6, 1e-8), (1e-3, 1e-4), (1e-3, 1e-4)]):
            snap = r["snapshots"][i]
            for name, p in snap["gpu_dense"].items():
                exact = i == 0
                torch.testing.assert_close(snap["host_dense"][name], p, rtol=0 if exact else rtol,
                                           atol=0 if exact else atol)
            for layer, (lo, hi, weight, momentum) in snap["shards"].items():
                torch.testing.assert_close(weight, snap["gpu_tables"][layer][lo:hi], rtol=rtol, atol=atol)
                torch.testing.assert_close(momentum, snap["gpu_momentum"][layer][lo:hi], rtol=rtol, atol=atol)
    # the shards split each table's rows between the ranks
    for layer, (lo, hi, *_) in results[0]["snapshots"][0]["shards"].items():
        assert lo == 0 and hi == results[1]["snapshots"][0]["shards"][layer][0]


def test_step_plan_gives_rows_slots_in_first_reader_order():
    """StepPlan against a plain reading of its contract: the unique rows ordered by the first
    micro-batch that reads them, then by row; each lookup's slot holds its row; `add` splits a
    micro-batch's new rows into those the last update's plan lacks (read from the host) and those it
    holds (copied over, with their slots there); the sorted view and `find` agree with the rows by
    slot."""
    from trainer.engram_host import StepPlan

    g = torch.Generator().manual_seed(1)
    last = StepPlan()
    last.add(torch.randint(0, 400, (2, 7, 3), generator=g))
    addresses = [torch.randint(0, 400, (2, 7, 3), generator=g) for _ in range(4)]
    plan = StepPlan()
    returned = [plan.add(a, last) for a in addresses]
    first: dict[int, int] = {}
    for i, a in enumerate(addresses):
        for r in a.reshape(-1).tolist():
            first.setdefault(r, i)
    want = sorted(first, key=lambda r: (first[r], r))
    in_last = set(last.rows.tolist())
    assert 0 < len(in_last & set(want)) < len(want)  # both kinds occur
    assert plan.rows.tolist() == want
    assert plan.bounds == [0, *[sum(v <= i for v in first.values()) for i in range(4)]]
    for i, (host, hit, src) in enumerate(returned):
        chunk = plan.chunks[i].tolist()
        assert chunk == [r for r in want if first[r] == i]
        assert [chunk[j] for j in host.tolist()] == [r for r in chunk if r not in in_last]
        copied = [r for r in chunk if r in in_last]
        assert [chunk[j] for j in hit.tolist()] == last.rows[src].tolist() == copied
        assert plan.from_host[i] == host.numel()
    for a, slots in zip(addresses, plan.slots):
        assert torch.equal(plan.rows[slots], a)
    assert plan.sorted_rows.tolist() == sorted(want)
    assert torch.equal(plan.rows[plan.sorted_slots], plan.sorted_rows)
    hit, slots = plan.find(torch.tensor([want[5], 10_000, want[0], -1]))
    assert hit.tolist() == [0, 2] and slots.tolist() == [5, 0]


def test_sharded_sinkhorn_balance_matches_the_whole_matrix():
    """sinkhorn_balance over two row shards, their sums added (the all-reduce of two owners), equals
    the balance of the whole matrix on each shard's rows."""
    import threading

    from optim.sinkhorn import sinkhorn_balance

    torch.manual_seed(0)
    U = torch.randn(50, 16)
    U[7] = 0.0  # an untouched row
    U[9] *= 1e-6  # a row under the threshold
    whole = sinkhorn_balance(U, 11, 1e-3)
    parts = (U[:20], U[20:])
    barrier = threading.Barrier(2)
    slots: list = [None, None]

    def summer(i):
        def row_sum(t):
            slots[i] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return row_sum

    results: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, sinkhorn_balance(parts[i], 11, 1e-3, row_sum=summer(i)))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    torch.testing.assert_close(torch.cat(results), whole, rtol=1e-6, atol=1e-7)
    assert (torch.cat(results)[[7, 9]] == 0).all()


@pytest.mark.parametrize("value, cp, needle", [("cpu", 1, "expected one of gpu, host"),
                                               ("host", 2, "context_parallel>1 is not supported")])
def test_bad_engram_tables_settings_are_config_errors(value, cp, needle):
    from conf.errors import ConfigError
    from trainer.engram_host import check_engram_tables

    with pytest.raises(ConfigError, match=needle):
        check_engram_tables(value, cp)


def test_host_tables_need_the_sinkhorn_route():
    """optim=adamw routes the tables to AdamW, which has no host path: one config error."""
    from conf.errors import ConfigError
    from conf.optim import AdamWConfig
    from trainer.engram_host import HostEngramTables

    with pytest.raises(ConfigError, match="routed to the Sinkhorn optimiser"):
        HostEngramTables(tiny_model(), AdamWConfig())


def test_side_threads_run_the_configured_intra_op_threads_and_leave_the_others():
    """trainer.engram_host_threads: the worker and the writer run a step's fetches and write-backs
    with that many intra-op threads, while the training thread, and a thread started afterwards (as
    the autograd engine's device threads, at the first backward), keep the process's count."""
    from concurrent.futures import ThreadPoolExecutor

    own = torch.get_num_threads()
    side = own + 2
    run = Run(host=True, threads=side)
    try:
        for step in batches(0, 2):
            run.step(step)
        run.host.synchronize()
        assert run.host.stats["fetches"] > 0 and run.host.stats["writebacks"] > 0
        assert run.host.side_thread_counts() == {"worker": side, "writer": side}
        assert torch.get_num_threads() == own
        with ThreadPoolExecutor(max_workers=1) as later:
            assert later.submit(torch.get_num_threads).result() == own
    finally:
        run.host.close()


def test_auto_side_threads_halve_what_two_leave_of_the_process_threads():
    from trainer.engram_host import side_thread_count

    own = torch.get_num_threads()
    try:
        torch.set_num_threads(16)
        assert side_thread_count(0) == 7 and side_thread_count(5) == 5
        torch.set_num_threads(2)
        assert side_thread_count(0) == 1
    finally:
        torch.set_num_threads(own)


def test_negative_engram_host_threads_is_a_one_line_config_error():
    from conf.errors import ConfigError
    from trainer.engram_host import HostEngramTables, check_engram_host_threads

    with pytest.raises(ConfigError, match=r"trainer\.engram_host_threads=-1: expected 0 \(auto\)") as error:
        check_engram_host_threads(-1)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"trainer\.engram_host_threads=-2"):
        HostEngramTables(tiny_model(), MuonConfig(), threads=-2)


def test_negative_engram_host_threads_through_the_cli_is_one_line(flashtrain, tmp_path):
    p = flashtrain("pretrain", "model=tiny", "logger=none", "trainer.engram_tables=host",
                   f"hydra.run.dir={tmp_path / 'run'}", "trainer.engram_host_threads=-1")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert "trainer.engram_host_threads=-1" in errors[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run started


# ---------------------------------------------------------------------------- the trainer (CLI)
HOST_RUN = ["model=tiny", "data.seq_len=128", "trainer.micro_batch_size=2", "trainer.grad_accum_steps=2",
            "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.progress=false",
            "logger=none", "optim=muon", "optim.warmup_steps=2", "trainer.max_steps=4",
            "trainer.save_every=2"]


def _losses(run) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow  # two trainer runs; test_host_table_resume_is_exact holds the same in the fast tier
def test_trainer_host_tables_resume_exactly_and_export_whole_tables(flashtrain, tmp_path):
    """`pretrain trainer.engram_tables=host`: the checkpoint holds the shards (in its manifest), a
    resume from step 2 repeats steps 3-4 and the final shards bit for bit, and the checkpoint's
    model weights (for evaluation or export) carry the whole tables."""
    import json
    import shutil

    from safetensors.torch import load_file

    from trainer.checkpoint import model_state

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    p = flashtrain("pretrain", *HOST_RUN, "trainer.engram_tables=host", f"hydra.run.dir={straight}")
    assert p.returncode == 0, p.stderr[-3000:]
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    p = flashtrain("pretrain", *HOST_RUN, "trainer.engram_tables=host", f"hydra.run.dir={resumed}")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(straight), _losses(resumed)
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]
    final = [run / "checkpoints" / "step_00000004" for run in (straight, resumed)]
    manifest = json.loads((final[0] / "manifest.json").read_text())["files"]
    shards = sorted(k for k in manifest if k.startswith("engram_host/"))
    assert len(shards) == 2  # the tiny model's two Engram layers
    for rel in shards:
        x, y = (load_file(str(f / rel)) for f in final)
        assert x.keys() == y.keys() == {"weight", "momentum"}
        assert all(torch.equal(x[k], y[k]) for k in x), rel
    state = model_state(final[0])
    for layer in (1, 2):
        table = state[f"engrams.{layer}.table.weight"]
        assert table.shape[1] == 32 and torch.isfinite(table).all()


@pytest.mark.slow
@pytest.mark.extended  # two whole trainer runs; the fast tier holds the same equality in process
def test_trainer_host_tables_match_gpu_tables(flashtrain, tmp_path):
    """The same run with the tables on the device and in host memory: the same losses to fp32
    rounding, and the same tables: to fp32 rounding after two steps; after four, within what
    Muon's orthogonalisation makes of that rounding in the other weights (fp64 cannot help
    here: the host shards are fp32 whatever the model's precision)."""
    from trainer.checkpoint import model_state

    runs = {}
    for where in ("gpu", "host"):
        runs[where] = tmp_path / where
        p = flashtrain("pretrain", *HOST_RUN, f"trainer.engram_tables={where}",
                       f"hydra.run.dir={runs[where]}")
        assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(runs["gpu"]), _losses(runs["host"])
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5 * abs(a[step]), (step, a[step], b[step])
    for step, (rtol, atol) in ((2, (RTOL, ATOL)), (4, (1e-2, 1e-3))):
        gpu, host = (model_state(runs[w] / "checkpoints" / f"step_{step:08d}") for w in ("gpu", "host"))
        for layer in (1, 2):
            name = f"engrams.{layer}.table.weight"
            torch.testing.assert_close(host[name], gpu[name], rtol=rtol, atol=atol)


def test_planner_counts_host_tables_off_the_gpu():
    """plan: a host-table layout holds the model less its tables (weights, gradients and Sinkhorn
    state) on the GPU, a micro-step's fetched rows instead, 8 bytes a table parameter over the
    ranks in host memory, and a non-zero host traffic; the GPU layout none of these."""
    from conf.plan import GPUS, ActivationRates, StepRates
    from model.transformer import Transformer
    from trainer.plan import Layout, ModelFacts, plan_rank, step_time

    cfg = dataclasses.replace(TinyModelConfig(), vocab_size=VOCAB, engram_min_rows=300)
    with torch.device("meta"):
        model = Transformer(cfg)
    facts = ModelFacts.of(model, MuonConfig())
    table = sum(e.table.weight.numel() for e in model.engrams.values())
    plans = {host: plan_rank(facts, Layout(4, zero_stage=0, micro_batch=2, seq_len=64, engram_host=host),
                             0, ActivationRates(), 2**40) for host in (False, True)}
    gpu, host = plans[False].parts, plans[True].parts
    assert gpu["parameters"] - host["parameters"] == 4 * table
    assert gpu["optimizer"] - host["optimizer"] == 4 * table  # Sinkhorn's one fp32 buffer
    lookups = 2 * 64 * len(cfg.engram_orders) * cfg.engram_heads * len(cfg.engram_layers)
    assert gpu["gradients"] - host["gradients"] == lookups * (cfg.engram_dim * 4 + 8)
    # a step's rows with their gradient and momentum, the last update's rows and momentum, a slot each
    assert host["engram rows in flight"] == lookups * (5 * cfg.engram_dim * 4 + 8)
    three = plan_rank(facts, Layout(4, zero_stage=0, micro_batch=2, seq_len=64, engram_host=True), 0,
                      ActivationRates(), 2**40, accumulation=3)
    assert three.parts["engram rows in flight"] == 3 * host["engram rows in flight"]
    assert (plans[False].host_bytes, plans[True].host_bytes) == (0, 8 * table // 4)
    times = {h: step_time(facts, p.layout, 0, 1, GPUS["h100"], 8, StepRates()) for h, p in plans.items()}
    assert times[False]["host traffic"] == 0 < times[True]["host traffic"]


@pytest.mark.slow
def test_trainer_host_tables_resume_at_another_world_size(flashtrain, tmp_path):
    """Two ranks write half of each table's rows; one rank resumes from their step-2 checkpoint,
    reads its rows from both files, and repeats the two-rank run's steps 3-4 (the same global batch)
    to fp32 rounding."""
    import shutil

    two, one = tmp_path / "two", tmp_path / "one"
    p = flashtrain("pretrain", *HOST_RUN, "trainer.engram_tables=host", "launcher.nproc=2",
                   f"hydra.run.dir={two}")
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(f.name for f in (two / "checkpoints" / "step_00000002" / "engram_host").iterdir())
    assert len(files) == 4 and files[0].startswith("layer01_rows000000000000-")  # two layers x two ranks
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_00000002", one / "checkpoints" / "step_00000002")
    shutil.copy(two / "metrics.jsonl", one / "metrics.jsonl")
    p = flashtrain("pretrain", *HOST_RUN, "trainer.engram_tables=host", "trainer.micro_batch_size=4",
                   f"hydra.run.dir={one}")
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(two), _losses(one)
    for step in (3, 4):
        assert abs(a[step] - b[step]) < 1e-5 * abs(a[step]), (step, a[step], b[step])
