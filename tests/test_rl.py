"""`flashtrain rl` end to end on CPU with a local Ray cluster: async and sync runs, resume,
per-effort metrics, actor-kill recovery with no lost or duplicated prompt, staleness masking
and version tagging."""
import json
import threading
import time

import pytest

pytest.importorskip("ray")

# a short run: the built-in SFT for a few steps, then a few RL versions
RL_FAST = ["logger=none", "trainer.torch_threads=1", "rl.prompts_per_step=4", "rl.group_size=2",
           "rl.max_new_tokens=16", "rl.eval_prompts=4", "rl.eval_every=0", "rl.rollout_workers=1",
           "rl.prompts_per_request=2", "rl.timeout_s=120",
           "rl.sft_overrides=['trainer.max_steps=4','trainer.save_every=4','trainer.eval_every=0',"
           "'trainer.micro_batch_size=2','sft.builtin_samples=256','eval.problems=2',"
           "'eval.max_new_tokens=16']"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_rl_runs_logs_per_effort_and_resumes_in_sync_mode(flashtrain, tmp_path):
    """An async run of 2 versions from the built-in SFT, then a resume to 3 with rl.async=false:
    in sync mode every sample comes from the weights being trained (lag 0, nothing stale)."""
    run = tmp_path / "rl"
    p = flashtrain("rl", *RL_FAST, "rl.steps=2", "rl.save_every=2", f"hydra.run.dir={run}", timeout=900)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    assert (run / "sft" / "checkpoints" / "latest").exists()  # the built-in SFT made the policy
    rows = _rows(run)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        efforts = {k.split("/")[0] for k in r if k.endswith("/len_mean")}
        assert efforts and efforts <= {"effort_50", "effort_75", "effort_100"}
        assert 0 <= r["task_reward"] <= 1 and r["samples_per_s"] > 0 and 0 <= r["trainer_idle_frac"] <= 1
        assert {f"{e}/len_p90" for e in efforts} <= set(r) and {f"{e}/accuracy" for e in efforts} <= set(r)
    evals = [r for r in rows if "eval/effort_50/accuracy" in r]
    assert len(evals) == 2 and {f"eval/effort_{e}/len_mean" for e in (50, 75, 100)} <= set(evals[-1])
    p = flashtrain("rl", *RL_FAST, "rl.steps=3", "rl.async=false", f"hydra.run.dir={run}", timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed at version 2" in p.stdout and "running the built-in SFT" not in p.stdout
    steps = [r for r in _rows(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["version_lag_mean"] == 0 and steps[-1]["stale_samples"] == 0
    # samples count the whole run; the rate only what this process trained (one version of 4 x 2)
    assert steps[-1]["samples"] == 3 * 4 * 2
    trained = [pid for r in steps for pid in r["prompt_ids"]]
    assert len(trained) == len(set(trained)) == 3 * 4  # no prompt trained twice, across the resume
    assert steps[-1]["samples_per_s"] * steps[-1]["elapsed_s"] == pytest.approx(4 * 2)
    assert abs(steps[-1]["behaviour_kl"]) < 0.1  # engine vs trainer log-probs of the same weights


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory, data_cache):
    """An in-process RL config (random-init policy) and the pretraining tokenizer."""
    from omegaconf import OmegaConf

    import conf
    from data import build_datasets
    from launch.cli import compose
    from launch.stages import all_stages

    conf.register({n: s.config for n, s in all_stages().items()})
    cfg, _ = compose("rl", ["logger=none", "trainer.torch_threads=1", f"data.cache_dir={data_cache}",
                            "rl.steps=6", "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=8",
                            "rl.eval_prompts=2", "rl.eval_every=0", "rl.save_every=0", "rl.rollout_workers=2",
                            "rl.reward_workers=2", "rl.prompts_per_request=1", "rl.timeout_s=120"])
    cfg = OmegaConf.to_object(cfg)
    run = tmp_path_factory.mktemp("rl_inproc")
    _, _, tok = build_datasets(cfg.data)
    tok.save(run / "tokenizer.json")
    return cfg, run


@pytest.mark.chaos
@pytest.mark.extended  # ~50 s of Ray start-up and deadlines: `pytest -m chaos` runs it
def test_killed_actors_restart_and_no_prompt_is_lost_or_trained_twice(rl_setup, local_ray):
    import ray

    from rl.coordinator import Coordinator

    cfg, run = rl_setup
    coord = None
    rows = []
    try:
        coord = Coordinator(cfg, run, str(run / "tokenizer.json"), None, rows.append)
        result = {}
        worker = threading.Thread(target=lambda: result.update(coord.run()), daemon=True)
        worker.start()
        deadline = time.time() + 300
        while coord.version < 1 and time.time() < deadline:  # kill in the middle of the run
            time.sleep(0.2)
        busy = sorted(coord.busy_rollout) or [0]
        ray.kill(coord.rollouts[busy[0]], no_restart=False)
        ray.kill(coord.rewards[0], no_restart=False)
        worker.join(timeout=600)
        assert not worker.is_alive()
        assert result["duplicates"] == 0 and coord.restarts["rollout"] + coord.restarts["reward"] >= 1
        assert rows and all(r["rollout_tokens_per_s"] > 0 for r in rows if "loss" in r)
        trained, admitted = coord.trained, set(coord.admitted)
        assert len(trained) == cfg.rl.steps * cfg.rl.prompts_per_step
        assert not trained & admitted and trained | admitted == set(range(coord.cursor))  # nothing lost

        # version tagging: every trained sample came from a version <= the one it trained at;
        # staleness: a batch generated at version 0 is stale for a trainer at version 6
        out = ray.get(coord.rollouts[0].generate.remote([coord.source.get(1000)[0]]))
        assert {s["version"] for s in out["samples"]} == {coord.version}
        for s in out["samples"]:
            s.update(version=0, advantage=1.0)
        stats = ray.get(coord.trainers[0].train_step.remote(out["samples"]))
        assert stats["stale_samples"] == len(out["samples"]) and stats["trained_tokens"] == 0
        assert stats["stale_lengths"] == [len(s["response"]) for s in out["samples"]]
    finally:  # the file's tests share local_ray: nothing of this one may outlive it
        if coord is not None:
            coord.shutdown()


@pytest.mark.slow
@pytest.mark.extended  # ~38 s under the suite's load; the default suite keeps RL sync mode with resume
def test_two_trainer_ranks_stay_in_sync(rl_setup, local_ray):
    """rl.trainer_workers=2: two DeepSpeed ranks (Ray actors, gloo) split each batch and reduce
    gradients, so after updates with non-zero advantages both hold the same, changed weights; with
    2 PPO epochs x 2 minibatches one version is 4 optimizer steps on each rank, in step."""
    import dataclasses

    import ray
    import torch

    from rl.coordinator import Coordinator

    cfg, run = rl_setup
    cfg = dataclasses.replace(cfg,
                              rl=dataclasses.replace(cfg.rl, steps=1, trainer_workers=2, rollout_workers=1,
                                                     reward_workers=1, ppo_epochs=2, minibatches=2))
    coord = None
    try:
        coord = Coordinator(cfg, run / "two_ranks", str(run / "tokenizer.json"), None, lambda row: None)
        coord.run()
        before = ray.get(coord.trainers[0].weights.remote())[1]
        samples = ray.get(coord.rollouts[0].generate.remote([coord.source.get(i)[0]
                                                             for i in range(2)]))["samples"]
        for k, s in enumerate(samples):
            s.update(version=coord.version, advantage=1.0 if k % 2 else -1.0)
        stats = ray.get([t.train_step.remote(samples) for t in coord.trainers], timeout=120)
        assert [s["updates"] for s in stats] == [4, 4]
        (v0, w0), (v1, w1) = ray.get([t.weights.remote() for t in coord.trainers])
        assert v0 == v1 == coord.version + 1
        params = [k for k in w0 if not k.endswith((".load", ".bias"))]  # router load counts are per rank
        assert all(torch.equal(w0[k], w1[k]) for k in params)
        assert any(not torch.equal(w0[k], before[k]) for k in params)
    finally:  # the file's tests share local_ray: nothing of this one may outlive it
        if coord is not None:
            coord.shutdown()


def test_a_bad_trainer_batch_fails_before_the_built_in_sft(flashtrain, tmp_path):
    """trainer.micro_batch_size=0 is refused before the built-in SFT trains (it used to surface
    only when the trainer actors built their engine, minutes later)."""
    run = tmp_path / "run"
    p = flashtrain("rl", *RL_FAST, "trainer.micro_batch_size=0", f"hydra.run.dir={run}")
    assert (p.returncode == 2
            and "trainer.micro_batch_size=0: must be at least 1" in p.stderr), p.stderr[-2000:]
    assert not (run / "sft").exists()


def test_actors_the_local_cluster_cannot_place_are_one_line_before_any_work(flashtrain, tmp_path):
    """Ray would leave them pending until rl.timeout_s and then raise GetTimeoutError."""
    p = flashtrain("rl", "logger=none", "rl.ray_num_cpus=2", f"hydra.run.dir={tmp_path / 'rl'}", timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("flashtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert ("1 trainer, 2 rollout and 1 reward actors need 4 CPUs but the cluster has 2"
            in errors[0]), errors[0]
    assert not (tmp_path / "rl" / "sft").exists()  # refused before the built-in SFT


def test_resource_shortfall_names_cpus_and_gpus():
    from types import SimpleNamespace

    from rl.run import actor_demand, resource_shortfall

    rl = SimpleNamespace(trainer_workers=2, rollout_workers=1, reward_workers=1, trainer_gpus=1.0,
                         rollout_gpus=0.5)
    need = actor_demand(rl, extra_actors=2)
    assert need == {"CPU": 6.0, "GPU": 2.5}
    assert resource_shortfall({"CPU": 8.0, "GPU": 4.0}, need, rl, 2) is None
    said = resource_shortfall({"CPU": 8.0, "GPU": 2.0}, need, rl, 2)
    assert "need 2.5 GPUs but the cluster has 2" in said and "2 teacher workers" in said and "CPU" not in said


@pytest.mark.parametrize("precision", ["bf16", "auto"])
def test_rollout_models_take_the_trainers_precision_on_their_device(precision):
    """A rollout worker on a GPU decodes in the precision the trainer's forward runs in there
    (trainer.precision=auto: bf16 on a GPU, fp32 on a CPU), with the MoE balancing counters fp32
    as the trainer keeps them; here on the CPU, with bf16 asked for explicitly."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from conf.model import TinyModelConfig
    from rl.workers import place_for_rollout
    from trainer.pretrain import assemble_model

    model, _ = assemble_model(dataclasses.replace(TinyModelConfig(), vocab_size=64))
    drafter = torch.nn.Linear(4, 4)
    place_for_rollout([model, None, drafter], SimpleNamespace(precision=precision), torch.device("cpu"))
    counters = {id(b) for r in model.routers() for b in (r.bias, r.bias_vl, *r.loads()) if b is not None}
    assert counters
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert all(p.dtype == want for p in model.parameters()) and drafter.weight.dtype == want
    for b in model.buffers():
        if b.is_floating_point():
            assert b.dtype == (torch.float32 if id(b) in counters else want)


@pytest.mark.parametrize("keys", [{"zero_stage": 2}, {"grad_accum_dtype": "bf16"}, {"param_dtype": "bf16"}],
                         ids=["zero2", "bf16-gradients", "bf16-weights"])
def test_the_policy_refuses_the_pretraining_trainers_gradient_and_weight_layouts(keys):
    from conf.errors import ConfigError
    from conf.trainer import TrainerConfig
    from rl.policy import check_policy_gradients

    tc = TrainerConfig(**{"zero_stage": 1, **keys})
    key, value = next(iter(keys.items()))
    with pytest.raises(ConfigError, match=f"trainer.{key}={value}.*RL/distillation policy"):
        check_policy_gradients(tc, composite=True)
    check_policy_gradients(TrainerConfig(zero_stage=1), composite=True)  # the default layout is fine
    check_policy_gradients(TrainerConfig(zero_stage=2), composite=False)  # DeepSpeed's own ZeRO-2
