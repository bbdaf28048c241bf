"""`flashtrain distill`: the teacher registry (dedup by checkpoint, vocabulary mismatch refused,
missing teacher named), domain-blocked prompts, LRU teacher multiplexing, and on a local Ray
cluster: samples routed to their domain's teacher, a killed teacher worker restarted with its
samples retried, a hung one (past rl.timeout_s) likewise, and a resumed run. The chunked reverse
KL itself is tests/test_distill_kl.py."""
import dataclasses
import os
import threading
import time

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("transformers")

# teacher checkpoint (under teacher_root) -> its domains; "hf" is a transformers Llama
REGISTRY = {"small_a": ["reverse"], "small_b": ["add7", "upper"], "hf": ["length"]}


def small_config(vocab):
    """A flashtrain teacher config unlike the student's (tiny): narrower and shallower."""
    from conf.model import TinyModelConfig

    return dataclasses.replace(TinyModelConfig(), vocab_size=vocab, dim=64, n_layers=4, n_encoder_layers=2,
                               engram_layers=[1], moe_inter_dim=64, n_routed_experts=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_cache):
    """Config, tokenizer and teachers (random weights: routing, faults and resume do not need
    trained ones), plus a random-init student checkpoint as the policy."""
    from omegaconf import OmegaConf

    import conf
    from conf.distill import TeacherConfig
    from data import build_datasets
    from launch.cli import compose
    from launch.stages import all_stages
    from rl.distill.make_teachers import flashtrain_model, hf_llama, save_flashtrain

    conf.register({n: s.config for n, s in all_stages().items()})
    cfg, _ = compose("distill", ["logger=none", "trainer.torch_threads=1", f"data.cache_dir={data_cache}",
                                 "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=2",
                                 "rl.max_new_tokens=6", "rl.prompts_per_request=2", "rl.save_every=0",
                                 "rl.timeout_s=120", "distill.eval_prompts=1", "distill.domain_block=2",
                                 "distill.teacher_batch=4", "distill.max_resident=1", "distill.cpu_cache=1",
                                 "distill.teacher_workers=1"])
    cfg = OmegaConf.to_object(cfg)
    root = tmp_path_factory.mktemp("distill")
    _, _, tok = build_datasets(cfg.data)
    tok.save(root / "tokenizer.json")
    V = tok.vocab_size
    for seed, name in enumerate(("small_a", "small_b")):
        model, mcfg = flashtrain_model(small_config(V), tok, seed + 1)
        save_flashtrain(model, mcfg, root / "teachers" / name)
    hf_llama(V, 3).save_pretrained(root / "teachers" / "hf")
    student, scfg = flashtrain_model(cfg.model, tok, 0)
    (root / "student").write_text(str(save_flashtrain(student, scfg, root / "student_run")))
    domains = {d: TeacherConfig(checkpoint=name if name == "hf" else f"{name}/checkpoints",
                                arch="hf" if name == "hf" else "flashtrain")
               for name, ds in REGISTRY.items() for d in ds}
    cfg = dataclasses.replace(cfg,
                              distill=dataclasses.replace(cfg.distill, teacher_root=str(root / "teachers"),
                                                          domains=domains))
    return cfg, root, tok


def test_registry_dedupes_by_checkpoint_and_names_a_missing_teacher(setup, tmp_path):
    from conf.distill import DistillLoopConfig, TeacherConfig
    from rl.distill.teachers import TeacherError, place_teachers, resolve_teachers

    cfg, root, _ = setup
    routes, specs = resolve_teachers(cfg.distill)
    assert len(specs) == 3 and set(routes) == {"reverse", "add7", "upper", "length"}
    assert routes["add7"] == routes["upper"] == str(
        (root / "teachers/small_b/checkpoints/step_00000001").resolve())
    assert {s.arch for s in specs if s.key == routes["length"]} == {"hf"}
    hosted = place_teachers(specs, 2)
    assert sorted(s.key for h in hosted for s in h) == sorted(s.key for s in specs)  # each once (1 replica)
    two = place_teachers([dataclasses.replace(specs[0], replicas=2)], 2)
    assert two[0] == two[1] == [dataclasses.replace(specs[0], replicas=2)]
    default = DistillLoopConfig().domains  # the default registry: 42 domains, 41 distinct teachers
    assert len(default) >= 40 and len({t.checkpoint for t in default.values()}) == len(default) - 1
    broken = dataclasses.replace(cfg.distill,
                                 domains={**cfg.distill.domains, "rot1": TeacherConfig(checkpoint="gone")})
    with pytest.raises(TeacherError, match="teacher 'gone' \\(domain rot1\\) fails to load"):
        resolve_teachers(broken)


def test_vocabulary_mismatch_is_refused_by_name(setup):
    from conf.distill import TeacherConfig
    from rl.distill.make_teachers import flashtrain_model, hf_llama, save_flashtrain
    from rl.distill.teachers import TeacherWorker, resolve_teachers

    cfg, root, tok = setup
    V = tok.vocab_size
    # a padded vocabulary: still not the student's
    model, mcfg = flashtrain_model(small_config(V + 64), tok, 5)
    save_flashtrain(model, mcfg, root / "teachers" / "wide")
    hf_llama(V - 96, 6).save_pretrained(root / "teachers" / "hf_narrow")
    domains = {"rot1": TeacherConfig(checkpoint="wide/checkpoints"),
               "rot2": TeacherConfig(checkpoint="hf_narrow", arch="hf"),
               "reverse": cfg.distill.domains["reverse"]}
    _, specs = resolve_teachers(dataclasses.replace(cfg.distill, domains=domains))
    errors = TeacherWorker(specs, str(root / "tokenizer.json"), V, 1, 1).check()
    assert len(errors) == 2
    assert any(f"teacher 'wide/checkpoints' (domains rot1) has a {V + 64}-token vocabulary, the student "
               f"{V}" in e for e in errors)
    assert any(f"teacher 'hf_narrow' (domains rot2) has a {V - 96}-token vocabulary" in e for e in errors)


def test_same_size_other_tokenizer_is_refused(setup):
    """A teacher shipping a tokenizer.json of the student's size but with two tokens' ids
    swapped scores other tokens than the student's: refused by name; its own copy passes."""
    import json

    from conf.distill import TeacherConfig
    from rl.distill.make_teachers import hf_llama
    from rl.distill.teachers import TeacherWorker, resolve_teachers

    cfg, root, tok = setup
    V = tok.vocab_size
    for name in ("hf_same", "hf_swapped"):
        hf_llama(V, 7).save_pretrained(root / "teachers" / name)
    tok.save(root / "teachers" / "hf_same" / "tokenizer.json")
    spec = json.loads((root / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = tok.encode(" the")[0], tok.encode(" and")[0]
    ta, tb = tok.id_to_token(a), tok.id_to_token(b)
    vocab[ta], vocab[tb] = b, a
    (root / "teachers" / "hf_swapped" / "tokenizer.json").write_text(json.dumps(spec))
    domains = {"rot1": TeacherConfig(checkpoint="hf_same", arch="hf"),
               "rot2": TeacherConfig(checkpoint="hf_swapped", arch="hf")}
    _, specs = resolve_teachers(dataclasses.replace(cfg.distill, domains=domains))
    errors = TeacherWorker(specs, str(root / "tokenizer.json"), V, 1, 1).check()
    assert (len(errors) == 1
            and "teacher 'hf_swapped' (domains rot2) has another tokenizer" in errors[0]), errors
    assert "2 tokens differ" in errors[0]


def test_public_layout_and_imported_teachers_load_by_their_model_preset(setup, tmp_path):
    """A teacher in the public layout, or made from one by `flashtrain convert import`, records no
    model config: the registry asks for distill.domains.<d>.model; given it, both routes load the
    weights the layout holds (those import_into_model puts in a model) and score alike."""
    from conf.distill import TeacherConfig
    from conf.errors import ConfigError
    from conf.model import TinyModelConfig
    from rl.distill.make_teachers import flashtrain_model
    from rl.distill.teachers import TeacherError, load_teacher, resolve_teachers
    from trainer.interop.convert import export_model, import_checkpoint, import_into_model

    cfg, _, tok = setup
    V = tok.vocab_size
    tiny = dataclasses.replace(TinyModelConfig(), vocab_size=V)
    quiet = lambda _: None  # noqa: E731
    teachers = tmp_path / "teachers"
    export_model(flashtrain_model(tiny, tok, 9)[0], teachers / "public", log=quiet)
    ckpt = import_checkpoint(teachers / "public", teachers / "imported" / "checkpoints", tiny, log=quiet)
    snapped = flashtrain_model(tiny, tok, 10)[0]
    import_into_model(snapped, teachers / "public", log=quiet)
    # two levels above the public dir, where a checkpoint's run dir would be: not the teacher's tokenizer
    (tmp_path / "tokenizer.json").write_text("not this teacher's")
    distill = lambda domains: dataclasses.replace(cfg.distill, teacher_root=str(teachers), domains=domains)  # noqa: E731
    for name in ("public", "imported/checkpoints"):
        with pytest.raises(TeacherError,
                           match=f"teacher '{name}' \\(domain rot1\\) fails to load: .* records no model "
                                 "config; name its architecture with distill.domains.rot1.model=tiny"):
            resolve_teachers(distill({"rot1": TeacherConfig(checkpoint=name)}))
    routes, specs = resolve_teachers(distill({"rot1": TeacherConfig(checkpoint="public", model="tiny"),
                                             "rot2": TeacherConfig(checkpoint="imported/checkpoints",
                                                                   model="tiny")}))
    assert routes["rot2"] == str(ckpt.resolve()) and [s.model for s in specs] == ["tiny", "tiny"]
    ids = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for spec in specs:
        teacher = load_teacher(spec, tok, V)
        for name, value in snapped.state_dict().items():
            assert torch.equal(teacher.state_dict()[name], value), (spec.name, name)
        with torch.no_grad():
            logits.append(teacher(ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    with pytest.raises(ConfigError,
                       match="distill.domains.rot1.model='huge': expected one of tiny, small, flash"):
        resolve_teachers(distill({"rot1": TeacherConfig(checkpoint="public", model="huge")}))
    with pytest.raises(ConfigError, match="distill.domains.rot1.model='tiny': only for arch=flashtrain"):
        resolve_teachers(distill({"rot1": TeacherConfig(checkpoint="public", arch="hf", model="tiny")}))


def test_cli_reports_a_missing_teacher_by_name(flashtrain, tmp_path):
    p = flashtrain("distill", "logger=none", f"distill.teacher_root={tmp_path}",
                   "distill.only=[reverse,add7]", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert p.returncode == 2
    assert ("teacher 'add7/checkpoints' (domain add7) fails to load" in p.stderr
            and len(p.stderr.splitlines()) == 1)
    p = flashtrain("distill", "logger=none", f"distill.teacher_root={tmp_path}", "distill.kl_mean=sample",
                   f"hydra.run.dir={tmp_path / 'run2'}", timeout=120)
    assert p.returncode == 2 and "distill.kl_mean='sample': expected one of token, domain" in p.stderr
    assert len(p.stderr.splitlines()) == 1


def test_the_declared_builtin_domains_are_the_implemented_ones():
    """conf declares the built-in domain names (the default teacher registry); tasks implements them."""
    from conf.distill import BUILTIN_DOMAINS
    from tasks.distill_domains import ARITHMETIC, TEXT, TransformDomain

    assert list(BUILTIN_DOMAINS) == [*TEXT, *ARITHMETIC]
    for name in BUILTIN_DOMAINS:
        TransformDomain(name)  # raises for a name it does not implement


@pytest.mark.parametrize("kl_weight, warn_steps", [(1.0, 0), (0.0, 5)])
def test_equal_rewards_warn_only_when_nothing_else_trains(kl_weight, warn_steps):
    """RL warns after rl.flat_reward_warn_steps (5) steps of equal rewards in every group: its
    policy loss is then 0. A distillation student still learns from the KL to its teachers, so
    the warning is off unless distill.kl_weight is 0."""
    from conf.distill import DistillConfig
    from rl.distill.run import distill_rl_config

    cfg = DistillConfig()
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, kl_weight=kl_weight))
    assert cfg.rl.flat_reward_warn_steps == 5
    out = distill_rl_config(cfg, {"reverse": "teacher", "add7": "teacher"})
    assert out.rl.flat_reward_warn_steps == warn_steps
    assert set(out.rl.task_kwargs["domains"]) == {"reverse", "add7"}


def test_prompts_carry_their_domain_in_blocks():
    from rl.distill.prompts import DomainPromptSource
    from tasks.distill_domains import DomainMixture

    class Chat:  # the chat format's prompt(), without a tokenizer
        def prompt(self, text, effort):
            return [effort, *map(ord, text)]

    names = ["reverse", "add7", "upper", "mod3"]
    source = DomainPromptSource(DomainMixture(dict.fromkeys(names)), Chat(), [50], [1.0], seed=3, block=3)
    got = [source.get(i) for i in range(3 * len(names) * 2)]
    for i, (prompt, problem) in enumerate(got):
        text = "".join(map(chr, prompt["ids"][1:]))
        assert text.startswith(prompt["domain"] + ": ") and problem.meta["domain"] == prompt["domain"]
        assert prompt["domain"] == got[i - i % 3][0]["domain"]  # a block of 3 shares its domain
        assert source.get(i)[0] == prompt  # a function of the index alone
    cycle = [got[b * 3][0]["domain"] for b in range(len(names))]
    assert sorted(cycle) == sorted(names)  # every domain once per cycle


def test_teachers_swap_lru_through_the_cpu_cache(setup):
    from rl.distill.teachers import TeacherWorker, resolve_teachers

    cfg, root, tok = setup
    routes, specs = resolve_teachers(cfg.distill)
    a, b, h = routes["reverse"], routes["add7"], routes["length"]
    worker = TeacherWorker(specs, str(root / "tokenizer.json"), tok.vocab_size, max_resident=1, cpu_cache=1)
    seqs = [([1, 5, 9, 12], [40, 41, 42]), ([1, 7], [50])]
    first, first_out, no_head = worker.score(a, seqs)
    for key in (b, h, b):
        worker.score(key, seqs)
    # a: disk; b: disk (a -> cache); h: disk (b -> cache, a dropped); b: cache (h -> cache)
    assert (worker.stats["from_disk"], worker.stats["from_cpu"], worker.stats["swaps"]) == (3, 1, 4)
    _, again, head = worker.score(a, seqs, with_head=True)  # a: disk again, the same numbers
    assert worker.stats["from_disk"] == 4 and worker.resident_keys() == [a]
    assert first["kind"] == "hidden" and [o.shape for o in first_out] == [(3, 64), (1, 64)]
    assert no_head is None and head.shape == (tok.vocab_size, 64)
    assert all(torch.equal(x, y) for x, y in zip(first_out, again))
    hf, hf_out, hf_head = worker.score(h, seqs, with_head=True)
    assert hf["kind"] == "logprobs" and hf_out[0].shape == (3, tok.vocab_size) and hf_head is None
    assert torch.allclose(hf_out[0].float().exp().sum(-1), torch.ones(3), atol=0.02)
    assert worker.stats["from_cpu"] == 1 and worker.stats["swap_s"] > 0


def _expected_teacher_view(setup, key: str, sample: dict) -> torch.Tensor:
    """What `sample`'s teacher must have sent, computed here from the checkpoint directly."""
    from pathlib import Path

    from model.runtime import AttentionRuntime
    from rl.distill.make_teachers import flashtrain_model
    from trainer.checkpoint import load_model_weights

    cfg, root, tok = setup
    ids = torch.tensor([sample["prompt"] + sample["response"]])
    p, r = len(sample["prompt"]), len(sample["response"])
    if Path(key).name == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(key).eval()
        out = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), -1)
    else:
        model, _ = flashtrain_model(small_config(tok.vocab_size), tok, 0)
        load_model_weights(model, Path(key))
        out = model.eval().hidden(ids[:, :-1], AttentionRuntime(1, ids.shape[1] - 1, torch.device("cpu")))
    return out[0, p - 1:p - 1 + r]


def _run_in_thread(coord) -> tuple[threading.Thread, dict]:
    """coord.run() in a thread, so the test can disturb its workers; the result dict gets the
    run's result, or its exception under "error"."""
    result: dict = {}

    def run():
        try:
            result.update(coord.run())
        except BaseException as e:  # surfaced by the test
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, result


@pytest.mark.chaos
@pytest.mark.slow
def test_routing_teacher_crash_recovery_and_resume(setup, local_ray):
    """One run on Ray: every trained sample carries its prompt's domain and exactly what that
    domain's teacher computes for it; a teacher worker killed mid-call is restarted and its
    samples retried, no prompt lost or trained twice; then a second coordinator resumes."""
    import ray

    from rl.distill.coordinator import DistillCoordinator
    from rl.distill.run import distill_rl_config
    from rl.distill.teachers import resolve_teachers

    cfg, root, tok = setup
    teachers = resolve_teachers(cfg.distill)
    cfg = distill_rl_config(cfg, teachers[0])
    expected_teacher = {d: str((root / "teachers" / n).resolve()) for n, ds in REGISTRY.items() for d in ds}

    class Recording(DistillCoordinator):
        def _train_calls(self, samples):
            self.trained_samples = getattr(self, "trained_samples", []) + samples
            return super()._train_calls(samples)

    coord = None
    rows = []
    try:
        coord = Recording(cfg, root / "run", str(root / "tokenizer.json"), (root / "student").read_text(),
                          rows.append, tok.vocab_size, teachers)
        worker, result = _run_in_thread(coord)
        deadline = time.time() + 300
        while coord.restarts["teacher"] == 0 and worker.is_alive() and time.time() < deadline:
            busy = sorted(coord.busy_teacher)
            if busy and coord.version >= 1:  # kill a teacher worker in the middle of a call
                ray.kill(coord.teachers[busy[0]], no_restart=False)
                time.sleep(0.5)
            time.sleep(0.02)
        worker.join(timeout=600)
        assert not worker.is_alive() and "error" not in result, result.get("error")
        assert coord.restarts["teacher"] >= 1 and result["duplicates"] == 0
        assert (len(coord.trained) == 4 * 4
                and set(coord.trained) | set(coord.admitted) == set(range(coord.cursor)))

        samples = coord.trained_samples
        assert len(samples) == 4 * 4 * 2
        for s in samples:
            domain = coord.source.domain_of(s["id"])
            assert s["domain"] == domain and tok.decode(s["prompt"]).find(f"{domain}: ") >= 0
            assert str(s["teacher"]).startswith(expected_teacher[domain])
        seen = {}
        for s in samples:  # one sample per teacher, recomputed from its checkpoint
            if s["response"] and s["teacher"] not in seen:
                seen[s["teacher"]] = s
        assert len(seen) >= 2
        for key, s in seen.items():
            want = _expected_teacher_view(setup, key, s)
            ref, j = s["teacher_out"]  # a reference: the teacher's bytes never came through the driver
            got = ray.get(ref)[j].float()
            assert got.shape == want.shape and torch.allclose(got, want, atol=0.05, rtol=0.02), key

        steps = [r for r in rows if "loss" in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        assert all(r["kl"] > 0 and r["teacher_tokens_per_s"] > 0 for r in steps)
        assert steps[-1]["restarts_teacher"] >= 1 and steps[-1]["teacher_swap_s"] > 0
        evals = [r for r in rows if "eval/mean_score" in r]
        assert len(evals) == 2 and all(f"eval/{d}/kl" in evals[-1] or f"eval/{d}/score" in evals[-1]
                                       for d in expected_teacher)
        first_trained = set(coord.trained)
        coord.shutdown()

        resumed_cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, steps=5))
        rows.clear()
        coord = DistillCoordinator(resumed_cfg, root / "run", str(root / "tokenizer.json"),
                                   (root / "student").read_text(), rows.append, tok.vocab_size, teachers)
        coord.run()
        assert coord.version == 5 and [r["step"] for r in rows if "loss" in r] == [5]
        assert coord.trained and not coord.trained & first_trained  # nothing trained twice across the resume
        coord.shutdown()

        # the distilled student's checkpoint records its model config, so it can teach in turn
        from rl.distill.teachers import TeacherSpec, load_teacher
        from trainer.checkpoint import model_state, resolve_checkpoint

        ckpt = resolve_checkpoint(root / "run")
        student = load_teacher(TeacherSpec(str(ckpt), "student", "flashtrain", 1, ("add7",)), tok,
                               tok.vocab_size)
        saved = model_state(ckpt)
        assert ckpt.name.endswith("5") and all(torch.equal(v, saved[k])
                                               for k, v in student.state_dict().items())
    finally:  # the file's tests share local_ray: nothing of this one may outlive it
        if coord is not None:
            coord.shutdown()


def _hangs_once_worker(armed: str, hung: str):
    """A teacher worker class whose first scoring call after the file `armed` appears sleeps far
    past any timeout (the file `hung` records it, so the restarted worker does not hang again)."""
    from rl.distill.teachers import TeacherWorker

    class HangsOnce(TeacherWorker):
        def score(self, key, seqs, with_head=False):
            if os.path.exists(armed) and not os.path.exists(hung):
                open(hung, "w").close()
                time.sleep(3600)
            return super().score(key, seqs, with_head)

    return HangsOnce


@pytest.mark.chaos
@pytest.mark.extended  # ~50 s of Ray start-up and deadlines: `pytest -m chaos` runs it
def test_a_hung_teacher_is_restarted_and_its_samples_retried(setup, tmp_path, local_ray):
    """A teacher call that outlives rl.timeout_s: the worker is killed and restarted by Ray, the
    call's prompts go back to waiting, and every prompt is still trained exactly once."""

    from rl.distill.coordinator import DistillCoordinator
    from rl.distill.run import distill_rl_config
    from rl.distill.teachers import resolve_teachers

    cfg, root, tok = setup
    teachers = resolve_teachers(cfg.distill)
    cfg = distill_rl_config(cfg, teachers[0])
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, timeout_s=10.0))
    armed, hung = str(tmp_path / "armed"), str(tmp_path / "hung")

    class HungTeacher(DistillCoordinator):
        teacher_worker = _hangs_once_worker(armed, hung)  # a local class: Ray ships it by value

    coord = None
    rows = []
    try:
        coord = HungTeacher(cfg, tmp_path / "run", str(root / "tokenizer.json"),
                            (root / "student").read_text(), rows.append, tok.vocab_size, teachers)
        worker, result = _run_in_thread(coord)
        while coord.version < 1 and worker.is_alive():  # arm once the start-of-run eval is done
            time.sleep(0.05)
        open(armed, "w").close()
        worker.join(timeout=600)
        assert not worker.is_alive() and "error" not in result, result.get("error")
        assert os.path.exists(hung), "no teacher call came after arming: the hang was never exercised"
        assert coord.restarts["teacher"] >= 1 and result["duplicates"] == 0
        assert len(coord.trained) == 4 * 4
        assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    finally:  # the file's tests share local_ray: nothing of this one may outlive it
        if coord is not None:
            coord.shutdown()


def test_student_objective_matches_the_model_logits_and_the_rl_loss(setup):
    """distill_objective on a student: the KL term equals the unchunked reverse KL of the model's
    own logits at the response positions, and reward_weight adds exactly that multiple of the RL
    trainer's policy loss (rl/policy.py's log-probs through the full forward)."""
    from rl.algorithm import policy_loss
    from rl.distill.kl import reverse_kl_reference
    from rl.distill.make_teachers import flashtrain_model
    from rl.distill.student import distill_objective
    from rl.policy import response_logprobs

    cfg, root, tok = setup
    V = tok.vocab_size
    model, _ = flashtrain_model(small_config(V), tok, 7)
    model.eval()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, r) in enumerate([(5, 3), (7, 1), (4, 4)]):
        samples.append({"prompt": torch.randint(5, V, (p,), generator=g).tolist(),
                        "response": torch.randint(5, V, (r,), generator=g).tolist(),
                        "behaviour": (-torch.rand(r, generator=g) * 5).tolist(),
                        "advantage": [1.0, -0.5, 0.25][i],
                        "domain": "add7" if i < 2 else "reverse", "teacher": "t", "teacher_kind": "logprobs",
                        "teacher_out": torch.log_softmax(torch.randn(r, V, generator=g), -1)})
    fresh = torch.tensor([True, True, False])  # the third is stale: out of both terms
    kl_only = dataclasses.replace(cfg.distill, kl_weight=1.0, reward_weight=0.0, token_chunk=3,
                                  vocab_chunk=1000, kl_mean="token")
    loss_kl, stats = distill_objective(model, samples, fresh, {}, tok.pad_id, kl_only, cfg.rl)
    logits, targets = [], []
    for s in samples[:2]:
        ids = torch.tensor([s["prompt"] + s["response"]])
        p, r = len(s["prompt"]), len(s["response"])
        logits.append(model(ids).logits[0, p - 1:p - 1 + r])
        targets.append(s["teacher_out"])
    want = reverse_kl_reference(torch.cat(logits), torch.cat(targets))
    assert torch.allclose(loss_kl, want, rtol=1e-4, atol=1e-5)
    assert set(stats["kl_by_domain"]) == {"add7"} and stats["kl_by_domain"]["add7"][1] == 4

    # kl_mean=domain: every domain's token mean weighs the same; with the first sample stale,
    # add7 has 1 response token and reverse 4, so the token mean differs
    uneven = torch.tensor([False, True, True])
    by_domain = dataclasses.replace(kl_only, kl_mean="domain")
    loss_dom, stats = distill_objective(model, samples, uneven, {}, tok.pad_id, by_domain, cfg.rl)
    per_domain = []
    for s in samples[1:]:
        ids = torch.tensor([s["prompt"] + s["response"]])
        p, r = len(s["prompt"]), len(s["response"])
        per_domain.append(reverse_kl_reference(model(ids).logits[0, p - 1:p - 1 + r], s["teacher_out"]))
    assert torch.allclose(loss_dom, torch.stack(per_domain).mean(), rtol=1e-4, atol=1e-5)
    token_mean = (per_domain[0] * 1 + per_domain[1] * 4) / 5
    assert abs(stats["kl"] - float(token_mean)) < 1e-4 and not torch.allclose(loss_dom, token_mean, rtol=1e-3)

    mixed = dataclasses.replace(kl_only, reward_weight=0.5)
    loss_mix, stats = distill_objective(model, samples, fresh, {}, tok.pad_id, mixed, cfg.rl)
    logp, mask = response_logprobs(model, samples, tok.pad_id)
    behaviour = torch.zeros_like(logp)
    for i, s in enumerate(samples):
        behaviour[i, :len(s["behaviour"])] = torch.tensor(s["behaviour"])
    pg, _ = policy_loss(logp, behaviour, torch.tensor([s["advantage"] for s in samples]),
                        mask & fresh[:, None], cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.is_cap)
    assert torch.allclose(loss_mix, want + 0.5 * pg, rtol=1e-4, atol=1e-5)
    loss_mix.backward()
    assert model.head.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
