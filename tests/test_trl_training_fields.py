"""TRL's training fields and GRPOTrainer arguments, each doing what it does in TRL: optim / optimizers, schedules,
IterableDataset, save / eval / logging strategies, sampled evaluation (pass@k) and push_to_hub
(tests/test_trl_training_switches.py has save_only_model, columns, padding, precision and the smaller switches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from tests.conftest import small_args, training_lines
from tests.training_fields_support import _trainer


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it


def _metric_steps(folder: Path, key: str | None = None) -> list[int]:
    lines = [json.loads(x) for x in training_lines(folder / "metrics.jsonl")]
    return [x["step"] for x in lines if key is None or key in x]


# ---- optimizers and schedules -------------------------------------------------------------------------------------
def test_optim_names_build_the_named_optimizer_with_optim_args(tmp_path, tokenizer):
    sgd = _inner(_trainer(tmp_path, tokenizer, optim="sgd", optim_args="momentum=0.9,nesterov=True").optimizer)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    fused = _inner(_trainer(tmp_path, tokenizer).optimizer)  # TRL's default, adamw_torch_fused
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"]
    from transformers.optimization import Adafactor

    assert isinstance(_inner(_trainer(tmp_path, tokenizer, optim="adafactor").optimizer), Adafactor)
    with pytest.raises(ConfigError, match=r"optim='sgd' with optim_args='betas=3'"):
        _trainer(tmp_path, tokenizer, optim="sgd", optim_args="betas=3")


def test_optimizers_argument_is_the_optimizer_and_schedule_that_step(tmp_path, tokenizer):
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    before = [p.detach().clone() for p in model.parameters()]
    t = _trainer(tmp_path, tokenizer, model=model, optimizers=(opt, sched), max_steps=2)
    t.train()
    assert _inner(t.optimizer) is opt and t.scheduler is sched
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.25)  # stepped twice
    assert any(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, model.parameters()))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="optimizers\\[0\\] holds parameters that are not the model's"):
        _trainer(tmp_path, tokenizer, optimizers=(torch.optim.SGD(other.parameters(), lr=1.0), None))
    # built over the model before peft_config wraps it: every base weight frozen, no adapter in it — 2 "steps"
    # moved nothing (TRL too, silently)
    from peft import LoraConfig

    fresh = toy.build_model(tokenizer, seed=0, hidden_size=32)
    with pytest.raises(ConfigError, match=r"optimizers\[0\] leaves out 4 trainable parameters \(.*lora_A.*\), which "
                                          r"would never train"):
        GRPOTrainer(fresh, [lambda completions, **_: [0.0] * len(completions)], args=small_args(tmp_path),
                    train_dataset=toy.dataset(12), processing_class=tokenizer,
                    optimizers=(torch.optim.SGD(fresh.parameters(), lr=1.0), None),
                    peft_config=LoraConfig(r=2, target_modules=["q_proj"]))

    class Warmup:  # a schedule object whose state holds a function: its checkpoint would fail at the first save
        def __init__(self):
            self.curve = torch.sqrt

        def __call__(self, step):
            return 1.0

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup())
    with pytest.raises(ConfigError, match=r"optimizers\[1\] \(LambdaLR\): state_dict\(\).lr_lambdas\[0\].curve is a "
                                          "builtin_function_or_method, which a checkpoint"):
        _trainer(tmp_path, tokenizer, model=model, optimizers=(opt, sched))
    _trainer(tmp_path, tokenizer, model=model, optimizers=(opt, sched), save_only_model=True)  # nothing to save
    # an optimizer whose param_groups a checkpoint cannot hold (a tensor learning rate): named before training too
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    with pytest.raises(ConfigError, match=r"optimizers\[0\]: state_dict\(\).param_groups\[0\].lr is a Tensor"):
        _trainer(tmp_path, tokenizer, model=model, optimizers=(opt, None))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_lr_scheduler_kwargs_reach_the_schedule(tmp_path, tokenizer):
    # cosine: lr = lr0 · ½(1 + cos(2π · num_cycles · step / max_steps)); at step 2 of 4:
    # num_cycles 0.5 (default) → ½(1 + cos(π/2)) = 0.5;  num_cycles 1.0 → ½(1 + cos(π)) = 0
    lrs = []
    for kwargs in (None, {"num_cycles": 1.0}):
        t = _trainer(tmp_path, tokenizer, max_steps=4, learning_rate=1.0, lr_scheduler_type="cosine",
                     lr_scheduler_kwargs=kwargs)
        t.scheduler.step()
        t.scheduler.step()
        lrs.append(t.scheduler.get_last_lr()[0])
    assert lrs == [pytest.approx(0.5), pytest.approx(0.0, abs=1e-12)]


def test_logged_learning_rate_is_the_rate_the_step_used_at_the_logging_step(tmp_path, tokenizer):
    """transformers logs learning_rate (and grad_norm) as the value at the logging step, the rate that step used.
    linear, lr 1e-3, 4 steps: step k (1-based) uses 1e-3·(1 − (k−1)/4) → logging every 2 steps: 7.5e-4 at step 2,
    2.5e-4 at step 4 (the window's mean would be 8.75e-4 / 3.75e-4). warmup_steps 1: step 1 uses 0. warmup_ratio
    0.1 of 15 steps: ⌈1.5⌉ = 2 warm-up steps (transformers 4 rounds up)."""
    _trainer(tmp_path, tokenizer, max_steps=4, logging_steps=2, learning_rate=1e-3, lr_scheduler_type="linear").train()
    lines = [json.loads(x) for x in training_lines(tmp_path / "run" / "metrics.jsonl")]
    assert [(x["step"], x["learning_rate"]) for x in lines] == [(2, pytest.approx(7.5e-4)), (4, pytest.approx(2.5e-4))]
    assert "lr" not in lines[0] and "loss" in lines[0]
    _trainer(tmp_path, tokenizer, output_dir=str(tmp_path / "w"), max_steps=2, learning_rate=1e-3, warmup_steps=1,
             lr_scheduler_type="linear").train()
    assert json.loads(training_lines(tmp_path / "w" / "metrics.jsonl")[0])["learning_rate"] == 0.0
    assert GRPOConfig(warmup_ratio=0.1).warmup(15) == 2
    with pytest.raises(ConfigError, match="lr_scheduler_type='reduce_lr_on_plateau' is not one of"):
        GRPOConfig(lr_scheduler_type="reduce_lr_on_plateau")


def test_evaluate_takes_transformers_arguments(tmp_path, tokenizer):
    """evaluate(eval_dataset, ignore_keys, metric_key_prefix); a dict evaluates each dataset under its name; every
    call is logged (state.log_history) as transformers' evaluate() logs."""
    t = _trainer(tmp_path, tokenizer, max_steps=1)
    out = t.evaluate(eval_dataset=toy.dataset(2), metric_key_prefix="test", ignore_keys=["completions/mean_length"])
    # transformers' speed metrics too: 2 prompts, one batch of per_device_eval_batch_size (16) prompts
    lengths = [f"test_completions/{k}" for k in ("min_length", "max_length", "clipped_ratio", "mean_terminated_length",
                                                  "min_terminated_length", "max_terminated_length")]
    assert set(out) == {"test_reward", "test_reward_std", "test_rewards/_length/mean", "test_rewards/_length/std",
                        "test_frac_reward_zero_std", "test_num_tokens", *lengths, "epoch", "test_runtime",
                        "test_samples_per_second", "test_steps_per_second"}
    assert t.state.log_history[-1]["test_reward"] == out["test_reward"]
    assert out["test_samples_per_second"] == pytest.approx(2 / out["test_runtime"], rel=1e-2)
    assert out["test_steps_per_second"] == pytest.approx(1 / out["test_runtime"], rel=1e-2)
    both = t.evaluate(eval_dataset={"a": toy.dataset(2), "b": toy.dataset(3)})
    assert "eval_a_reward" in both and "eval_b_completions/mean_length" in both
    with pytest.raises(ConfigError, match="evaluate\\(\\) needs an eval_dataset"):
        t.evaluate()


def test_steps_given_as_fractions_of_max_steps(tmp_path, tokenizer):
    """transformers: logging_steps / save_steps / eval_steps below 1 are fractions of max_steps, rounded up.
    max_steps 4: logging 0.5 → every 2 steps; save 0.3 → ⌈1.2⌉ = every 2 steps; eval 0.75 → every 3 (and the end)."""
    t = _trainer(tmp_path, tokenizer, max_steps=4, logging_steps=0.5, save_steps=0.3, eval_strategy="steps",
                 eval_steps=0.75, eval_data=toy.dataset(2))
    t.train()
    assert (t.state.logging_steps, t.state.save_steps, t.state.eval_steps) == (2, 2, 3)
    assert _metric_steps(tmp_path / "run", "loss") == [2, 4] and _metric_steps(tmp_path / "run", "eval_reward") == [3, 4]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert GRPOConfig(logging_steps=5.0).logging_steps == 5
    with pytest.raises(ConfigError, match="logging_steps=2.5 must be a whole number of steps"):
        GRPOConfig(logging_steps=2.5)


def test_weight_decay_spares_biases_and_norms_as_transformers_does(tokenizer):
    from groupwise.optim import param_groups

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in no_decay["params"]) and no_decay["params"]  # Llama: RMSNorm weights
    assert all("norm" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ---- IterableDataset ------------------------------------------------------------------------------------------------
def _stream(n=12):
    from datasets import IterableDataset

    rows = toy.dataset(n)
    return IterableDataset.from_generator(lambda: iter(rows))


def test_iterable_dataset_needs_max_steps(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="IterableDataset: set max_steps"):
        _trainer(tmp_path, tokenizer, data=_stream(), max_steps=-1)


@pytest.mark.slow
def test_iterable_dataset_trains_wraps_around_and_resumes_exactly(tmp_path, tokenizer):
    # 12 rows, 2 prompts per round: 4 steps read 8 rows; 8 steps read 16, so the stream starts again (epoch 2)
    straight = _trainer(tmp_path, tokenizer, data=_stream(), max_steps=8, save_steps=4, output_dir=str(tmp_path / "a"))
    straight.train()
    assert straight.sampler.position == 16 and straight.train_data.length == 12
    resumed = _trainer(tmp_path, tokenizer, data=_stream(), max_steps=8, save_steps=4, output_dir=str(tmp_path / "b"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    for (name, a), b in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b), name


def test_a_bad_stream_row_names_its_number(tmp_path, tokenizer):
    from datasets import IterableDataset

    rows = toy.dataset(3) + [{"prompt": ""}] + toy.dataset(8)
    t = _trainer(tmp_path, tokenizer, data=IterableDataset.from_generator(lambda: iter(rows)), max_steps=2,
                 shuffle_dataset=False)  # read in order: row 3 is the fourth read
    with pytest.raises(ConfigError, match="train_dataset row 3 has an empty prompt"):
        t.train()


def test_every_process_reads_a_streamed_round_whole(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, data=_stream(5), max_steps=4)
    t.sampler.next_round()  # 2 prompts
    t.sampler.next_round()
    t.sampler.next_round()  # rows 4, 5 → the stream (5 rows) ended inside this round: its length is known
    assert t.train_data._next == 6 and t.train_data.length == 5 and t.sampler.progress() == pytest.approx(6 / 5)


def test_streamed_rows_get_the_length_checks(tmp_path, tokenizer):
    rows = toy.dataset(3) + [{**toy.dataset(1)[0], "prompt": "repeat a:" * 10}] + toy.dataset(8)
    from datasets import IterableDataset

    t = _trainer(tmp_path, tokenizer, data=IterableDataset.from_generator(lambda: iter(rows)), max_steps=2,
                 max_prompt_length=20, truncate_prompt="error", shuffle_dataset=False)
    with pytest.raises(ConfigError, match="train_dataset row 3 has 90 prompt tokens > max_prompt_length=20"):
        t.train()


def test_a_stream_is_shuffled_by_data_seed_and_eval_takes_a_dict_of_columns(tmp_path, tokenizer):
    # TRL: an IterableDataset is read through dataset.shuffle(seed=…) when shuffle_dataset (data_seed here)
    from datasets import IterableDataset

    rows = toy.dataset(12)

    def stream():
        return IterableDataset.from_generator(lambda: iter(rows))

    expected = [r["prompt"] for r in stream().shuffle(seed=7)]
    t = _trainer(tmp_path, tokenizer, data=stream(), max_steps=1, data_seed=7,
                 eval_data={"prompt": [r["prompt"] for r in rows[:3]], "letter": [r["letter"] for r in rows[:3]]})
    assert [t.train_data[i]["prompt"] for i in range(12)] == expected != [r["prompt"] for r in rows]
    assert [t.eval_data[i]["letter"] for i in range(3)] == [r["letter"] for r in rows[:3]]  # columns read as rows
    kept = _trainer(tmp_path, tokenizer, data=stream(), max_steps=1, shuffle_dataset=False)
    assert [kept.train_data[i]["prompt"] for i in range(12)] == [r["prompt"] for r in rows]


# ---- strategies -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_save_eval_and_logging_strategies(tmp_path, tokenizer):
    # 4 prompts, 2 per round: an epoch is 2 optimizer steps
    t = _trainer(tmp_path, tokenizer, data=toy.dataset(4), eval_data=toy.dataset(2), max_steps=4,
                 save_strategy="epoch", eval_strategy="epoch", logging_strategy="no", output_dir=str(tmp_path / "e"))
    t.train()
    assert sorted(p.name for p in (tmp_path / "e").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert _metric_steps(tmp_path / "e", "eval_reward") == [2, 4]
    assert _metric_steps(tmp_path / "e", "loss") == []  # logging 'no': no step (transformers: the summary only)
    assert "train_loss" in t.state.log_history[-1]
    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=4, save_strategy="no", eval_strategy="steps",
                 eval_steps=1, eval_delay=2, eval_on_start=True, output_dir=str(tmp_path / "s"))
    t.train()
    assert not list((tmp_path / "s").glob("checkpoint-*"))
    assert _metric_steps(tmp_path / "s", "eval_reward") == [0, 2, 3, 4]  # on start, then from step 2 on
    with pytest.raises(ConfigError, match="needs an eval_dataset"):
        _trainer(tmp_path, tokenizer, eval_strategy="steps")


def test_evaluate_is_on_demand_by_default(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=1, output_dir=str(tmp_path / "d"))
    t.train()
    assert _metric_steps(tmp_path / "d", "eval_reward") == []  # eval_strategy 'no', TRL's default
    assert "eval_completions/mean_length" in t.evaluate()


def test_eval_delay_counts_like_transformers(tmp_path, tokenizer):
    # transformers evaluates once global_step ≥ eval_delay: eval_steps 2, eval_delay 2 → steps 2 and 4
    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=4, eval_strategy="steps", eval_steps=2,
                 eval_delay=2, output_dir=str(tmp_path / "d"))
    t.train()
    assert _metric_steps(tmp_path / "d", "eval_reward") == [2, 4]


@pytest.mark.slow
def test_epoch_end_survives_a_resume_inside_the_round(tmp_path, tokenizer):
    # 12 prompts, 2 per round, 2 optimizer steps per round: an epoch is 12 steps; checkpoint-5 falls inside a round
    kw = dict(data=toy.dataset(12), eval_data=toy.dataset(2), max_steps=14, steps_per_generation=2, save_steps=5,
              eval_strategy="epoch", per_device_train_batch_size=4)
    _trainer(tmp_path, tokenizer, output_dir=str(tmp_path / "a"), **kw).train()
    resumed = _trainer(tmp_path, tokenizer, output_dir=str(tmp_path / "b"), **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-5"))
    assert _metric_steps(tmp_path / "a", "eval_reward") == [12, 14]
    assert _metric_steps(tmp_path / "b", "eval_reward") == [12, 14]


# ---- evaluation with k samples ---------------------------------------------------------------------------------------
def test_num_generations_eval_logs_mean_and_pass_at_k(tmp_path, tokenizer):
    seen: list[tuple[str, float]] = []

    def score(prompts, completions, **_):
        values = [float(c.count("a") > 0) for c in completions]
        seen.extend(zip(prompts, values))
        return values

    t = _trainer(tmp_path, tokenizer, funcs=(score,), eval_data=toy.dataset(5, seed=1), num_generations_eval=3,
                 per_device_eval_batch_size=2, max_completion_length=12)
    out = t.evaluate()
    assert len(seen) == 15  # 5 prompts × k = 3, sampled
    by_row = [seen[3 * i:3 * i + 3] for i in range(5)]
    assert all(len({p for p, _ in row}) == 1 for row in by_row)  # the k samples of a prompt are contiguous
    expected_pass = sum(max(v for _, v in row) for row in by_row) / 5
    expected_mean = sum(v for _, v in seen) / 15
    assert out["eval_rewards/score/pass@3"] == pytest.approx(expected_pass)
    assert out["eval_rewards/score/mean@3"] == pytest.approx(expected_mean) == out["eval_rewards/score/mean"]


@pytest.mark.slow
def test_sampled_evaluation_keeps_resume_exact(tmp_path, tokenizer):
    kw = dict(eval_data=toy.dataset(3), max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
              num_generations_eval=2)
    straight = _trainer(tmp_path, tokenizer, output_dir=str(tmp_path / "a"), **kw)
    straight.train()
    resumed = _trainer(tmp_path, tokenizer, output_dir=str(tmp_path / "b"), **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    for (name, a), b in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b), name


def test_evaluation_log_metric_stays_out_of_the_training_window(tmp_path, tokenizer):
    def reward(completions, log_metric, **_):
        log_metric("probe", 1.0)
        return [0.0] * len(completions)

    t = _trainer(tmp_path, tokenizer, funcs=(reward,), eval_data=toy.dataset(2), max_steps=1)
    out = t.evaluate()
    assert out["eval_probe"] == 1.0 and "probe" not in t._window


# ---- hub ------------------------------------------------------------------------------------------------------------
class _FakeHub:
    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private))
        return type("Repo", (), {"repo_id": f"user/{repo_id}" if "/" not in repo_id else repo_id})()

    def create_branch(self, repo, branch, exist_ok=False):
        self.calls.append(("create_branch", repo, branch))

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None, ignore_patterns=None):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, commit_message, revision, files, tuple(ignore_patterns)))
        from huggingface_hub import CommitInfo

        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/1", commit_message=commit_message,
                          commit_description="", oid="1", pr_url=None)


@pytest.mark.slow
def test_push_to_hub_uploads_the_model_at_every_save_and_at_the_end(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    _FakeHub.calls = []
    t = _trainer(tmp_path, tokenizer, max_steps=2, save_steps=1, push_to_hub=True, hub_model_id="me/tiny-grpo",
                 hub_token="hf_test", hub_private_repo=True)
    t.train()
    uploads = [c for c in _FakeHub.calls if c[0] == "upload_folder"]
    assert [c[2] for c in uploads] == ["groupwise: step 1", "groupwise: step 2"]  # the end is step 2: once
    assert t.hub_model_id == "me/tiny-grpo"  # transformers' attribute (TRL's script prints it; it did not exist)
    t.hub_model_id = "other/x"  # settable, as transformers' attribute: the next pushes go there
    assert t.hub_model_id == "other/x" == t.args.hub_model_id
    assert t.push_to_hub(commit_message="elsewhere") == "https://huggingface.co/other/x/commit/1"
    assert t.hub_model_id == "other/x"
    t.hub_model_id = "me/tiny-grpo"
    assert all(c[1] == "me/tiny-grpo" and "model.safetensors" in c[4] and "checkpoint-*" in c[5] for c in uploads)
    assert ("create_repo", "me/tiny-grpo", True) in _FakeHub.calls
    info = t.push_to_hub(commit_message="by hand")  # transformers returns upload_folder's CommitInfo: a str too
    assert info == "https://huggingface.co/me/tiny-grpo/commit/1" and info.oid == "1"
    # TRL's scripts/grpo.py ends with push_to_hub(dataset_name=…): a model card; transformers' token / private too
    _FakeHub.calls = []
    t.push_to_hub(dataset_name="trl-lib/DeepMath-103K", tags=["math"], private=False)
    card = (tmp_path / "run" / "README.md").read_text()
    assert "- trl-lib/DeepMath-103K" in card and "- math" in card and "README.md" in _FakeHub.calls[-1][4]
    assert ("create_repo", "me/tiny-grpo", False) in _FakeHub.calls
    # base_model is a hub id or nothing: a local folder (the policy loaded from disk) is left out, as TRL's card
    # does (it was the folder's absolute path, which the hub's metadata check refuses)
    t.unwrapped.config._name_or_path = str(tmp_path)
    t.push_to_hub()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "base_model" not in card and str(tmp_path) not in card
    t.unwrapped.config._name_or_path = "Qwen/Qwen2.5-0.5B"
    t.push_to_hub()
    assert "base_model: Qwen/Qwen2.5-0.5B" in (tmp_path / "run" / "README.md").read_text()
    with pytest.raises(TypeError, match=r"unexpected arguments \['datset_name'\]"):
        t.push_to_hub(datset_name="x")
    logged = json.loads(training_lines(tmp_path / "run" / "metrics.jsonl")[0])
    assert "hf_test" not in json.dumps(logged)  # the token never reaches the logs


def test_push_to_hub_without_credentials_stops_before_training(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ConfigError, match="push_to_hub needs a hub token: run `hf auth login`"):
        _trainer(tmp_path, tokenizer, push_to_hub=True)


def test_hub_token_never_printed():
    cfg = GRPOConfig(hub_token="hf_SECRET")
    assert "hf_SECRET" not in repr(cfg) and "hf_SECRET" not in str(cfg) and cfg.hub_token == "hf_SECRET"


class _FakeDatasetHub:
    """huggingface_hub.HfApi as log_completions_hub_repo and huggingface_hub's CommitScheduler call it: each commit
    recorded with the files it adds."""
    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, repo_type=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, repo_type))
        return type("Repo", (), {"repo_id": repo_id})()

    def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type=None, commit_message=None):
        self.calls.append(("upload_file", repo_id, path_in_repo, repo_type, path_or_fileobj.decode()))

    def run_as_future(self, fn, *args, **kwargs):  # the scheduler's commits, run now (its thread's first one too)
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args, **kwargs))
        return future

    def create_commit(self, repo_id, repo_type, operations, commit_message, revision=None):
        self.calls.append(("commit", repo_id, repo_type, sorted(op.path_in_repo for op in operations)))


def test_log_completions_hub_repo_uploads_the_parquet_tables_to_a_dataset(tmp_path, tokenizer, monkeypatch):
    """TRL's field: a dataset repository (private as hub_private_repo) with a card, that a CommitScheduler fills with
    the completions_<step>.parquet files; the end of training uploads the last ones. Without log_completions, or
    without a token, it is refused before training."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeDatasetHub)
    _FakeDatasetHub.calls = []
    t = _trainer(tmp_path, tokenizer, max_steps=2, logging_steps=1, log_completions=True, hub_token="hf_test",
                 log_completions_hub_repo="me/completions", hub_private_repo=True, hub_model_id="me/tiny-grpo")
    t.train()
    calls = _FakeDatasetHub.calls
    assert calls[0] == ("create_repo", "me/completions", True, "dataset")
    assert calls[1][:4] == ("upload_file", "me/completions", "README.md", "dataset")
    assert "https://huggingface.co/me/tiny-grpo" in calls[1][4] and 'load_dataset("me/completions")' in calls[1][4]
    uploaded = [path for c in calls if c[0] == "commit" for path in c[3]]
    assert sorted(uploaded) == ["completions_00001.parquet", "completions_00002.parquet"]  # each once
    with pytest.raises(ConfigError, match=r"log_completions_hub_repo='me/c' has no effect without "
                                          r"log_completions=True"):
        GRPOConfig(log_completions_hub_repo="me/c")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ConfigError, match=r"log_completions_hub_repo needs a hub token: run `hf auth login`"):
        _trainer(tmp_path, tokenizer, max_steps=1, log_completions=True, log_completions_hub_repo="me/c",
                 overwrite_output_dir=True)


def test_a_failed_last_completions_upload_warns_and_the_run_ends(tmp_path, tokenizer, monkeypatch):
    """The run is over and its tables are on disk: the last upload's failure is a warning naming how to upload them,
    not an error on the main process alone."""
    import huggingface_hub

    class Down(_FakeDatasetHub):
        def create_commit(self, *args, **kwargs):
            raise ConnectionError("the hub went away")

    monkeypatch.setattr(huggingface_hub, "HfApi", Down)
    t = _trainer(tmp_path, tokenizer, max_steps=1, logging_steps=1, log_completions=True, hub_token="hf_test",
                 log_completions_hub_repo="me/completions")
    with pytest.warns(RuntimeWarning, match=r"log_completions_hub_repo: the last upload to me/completions failed "
                                            r"\(ConnectionError: the hub went away\); the tables are in .*completions: "
                                            r"upload them with `hf upload me/completions"):
        t.train()
    assert t.state.global_step == 1
