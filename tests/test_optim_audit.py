"""Audit of the optimizer, the learning-rate schedule and the update step against transformers 5's Trainer and TRL
1.16's GRPOTrainer: the weight-decay groups, warm-up rounding, the schedule's total steps (max_steps from
num_train_epochs), the logged learning_rate, optim_args parsing and the 8-bit optimizers' embedding override."""

import json

import pytest
import torch
from transformers import Trainer, TrainingArguments, get_scheduler

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.optim import build_optimizer, build_schedule, param_groups
from groupwise.tasks import toy
from tests.conftest import small_args


def _config(**kw):
    return GRPOConfig(output_dir="unused", num_generations=2, per_device_train_batch_size=2, **kw)


class _Block(torch.nn.Module):
    """Names that exercise every one of transformers' no-decay rules, and some that look close but decay."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)  # proj.weight decays, proj.bias does not (r"bias")
        self.ln_f = torch.nn.LayerNorm(4)  # a torch LayerNorm whose name matches no pattern: excluded by type
        self.input_layernorm = torch.nn.Module()  # r"layernorm"
        self.input_layernorm.weight = torch.nn.Parameter(torch.ones(4))
        self.q_norm = torch.nn.Module()  # r"_norm(?:$|\.)"
        self.q_norm.weight = torch.nn.Parameter(torch.ones(4))
        self.norm = torch.nn.Module()  # r"(?:^|\.)norm(?:$|\.)"
        self.norm.weight = torch.nn.Parameter(torch.ones(4))
        self.normalizer = torch.nn.Linear(4, 4, bias=False)  # "normalizer.weight": no pattern matches, decays
        self.RMSNorm_scale = torch.nn.Parameter(torch.ones(4))  # r"rmsnorm" on the lower-cased name
        self.frozen = torch.nn.Linear(4, 4)  # not trainable: in no group
        self.frozen.requires_grad_(False)


def test_decay_groups_are_transformers_get_decay_parameter_names():
    """Trainer.create_optimizer: decay = trainable params named in get_decay_parameter_names, the rest 0.0.
    By hand for _Block: decay {proj.weight, normalizer.weight}; no decay {proj.bias, ln_f.weight, ln_f.bias,
    input_layernorm.weight, q_norm.weight, norm.weight, RMSNorm_scale}; frozen.* in neither."""
    tokenizer = toy.build_tokenizer()
    for model in (_Block(), toy.build_model(tokenizer, hidden_size=16, num_layers=1)):
        names = {id(p): n for n, p in model.named_parameters()}
        groups = param_groups(model, weight_decay=0.1)
        got = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in groups}
        hf_decay = set(Trainer.get_decay_parameter_names(None, model))  # self is not used
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert got[0.1] == sorted(n for n in trainable if n in hf_decay)
        assert got[0.0] == sorted(n for n in trainable if n not in hf_decay)
    block = _Block()
    got = {g["weight_decay"]: {n for n, p in block.named_parameters() if any(p is q for q in g["params"])}
           for g in param_groups(block, 0.1)}
    assert got[0.1] == {"proj.weight", "normalizer.weight"}
    assert got[0.0] == {"proj.bias", "ln_f.weight", "ln_f.bias", "input_layernorm.weight", "q_norm.weight",
                        "norm.weight", "RMSNorm_scale"}


@pytest.mark.parametrize("kw, n, expected", [
    (dict(warmup_steps=3), 10, 3),  # whole steps
    (dict(warmup_steps=1.5), 10, 1),  # ≥ 1: int(1.5) = 1, as TrainingArguments.get_warmup_steps
    (dict(warmup_steps=0.25), 10, 3),  # < 1: ceil(10 · 0.25) = ceil(2.5) = 3
    (dict(warmup_steps=0.1), 7, 1),  # ceil(0.7) = 1
    (dict(warmup_steps=0.0), 10, 0),
    (dict(warmup_ratio=0.25), 10, 3),  # transformers 4's warmup_ratio: ceil(2.5) = 3
    (dict(warmup_steps=2, warmup_ratio=0.5), 10, 2),  # warmup_steps wins, as in transformers 4
])
def test_warmup_steps_as_transformers_get_warmup_steps(kw, n, expected):
    assert _config(**kw).warmup(n) == expected
    if "warmup_ratio" not in kw:  # transformers 5 has no warmup_ratio
        assert TrainingArguments(output_dir="unused", **kw).get_warmup_steps(n) == expected


@pytest.mark.parametrize("name, kwargs", [("linear", None), ("cosine", None),
                                          ("cosine_with_restarts", {"num_cycles": 2}),
                                          ("polynomial", {"power": 2.0, "lr_end": 1e-4}), ("constant", None),
                                          ("constant_with_warmup", None), ("inverse_sqrt", None),
                                          ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                          ("warmup_stable_decay", {"num_decay_steps": 3})])
def test_schedule_is_transformers_get_scheduler_step_by_step(name, kwargs):
    """build_schedule over 10 steps with warmup_steps=0.3 (ceil(3.0) = 3 warm-up steps) gives the rate of
    Trainer.create_scheduler at every step 0..10. By hand for linear (lr 1.0): steps 0..3 warm up 0, 1/3, 2/3, 1,
    then (10 − s) / 7: 6/7, 5/7, …, 1/7, 0 at step 10."""
    args = _config(learning_rate=1.0, lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=0.3)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = build_schedule(ours_opt, args, max_steps=10)
    hf = get_scheduler(name, hf_opt, num_warmup_steps=TrainingArguments(output_dir="u", warmup_steps=0.3)
                       .get_warmup_steps(10), num_training_steps=10, scheduler_specific_kwargs=kwargs)
    got, want = [], []
    for _ in range(11):
        got.append(ours.get_last_lr()[0])
        want.append(hf.get_last_lr()[0])
        ours_opt.step(), ours.step(), hf_opt.step(), hf.step()
    assert got == pytest.approx(want, abs=1e-12)
    if name == "linear":
        assert got == pytest.approx([0, 1 / 3, 2 / 3, 1, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7, 0])


def test_fractional_epochs_give_transformers_max_steps_and_the_logged_rate_is_the_one_each_step_used(tmp_path):
    """16 prompts, 4 completions each, per_device_train_batch_size=8, steps_per_generation=2, gas=1: a generation
    round is 16 rows = 4 prompts, so 4 rounds per epoch of 2 optimizer steps each. TRL's dataloader has
    4 · 2 = 8 micro-steps per epoch → num_update_steps_per_epoch = 8 and max_steps = ceil(0.3 · 8) = ceil(2.4) = 3
    (whole rounds would give ceil(0.3 · 4) · 2 = 4); TrainerState.num_train_epochs = ceil(0.3) = 1.
    warmup_steps=0.5 → ceil(1.5) = 2 warm-up steps; linear, lr 1e-2 → rate used at step 1, 2, 3 (schedule steps
    0, 1, 2): 0, 0.005, 0.01; after the run the schedule is at step 3: (3 − 3) / (3 − 2) = 0."""
    tokenizer = toy.build_tokenizer()
    args = small_args(tmp_path, max_steps=-1, num_train_epochs=0.3, steps_per_generation=2,
                      lr_scheduler_type="linear", warmup_steps=0.5)
    trainer = GRPOTrainer(toy.build_model(tokenizer, hidden_size=16, num_layers=1), [toy.letter_reward], args=args,
                          train_dataset=toy.dataset(16), processing_class=tokenizer)
    assert (trainer.max_steps, trainer.steps_per_round, trainer.state.num_train_epochs) == (3, 2, 1)
    trainer.train()
    logged = [(h["step"], h["learning_rate"]) for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == [(1, 0.0), (2, pytest.approx(0.005)), (3, pytest.approx(0.01))]
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["learning_rate"] for x in lines if "learning_rate" in x] == pytest.approx([0.0, 0.005, 0.01])


@pytest.mark.slow
def test_epochs_of_a_dataset_that_is_not_whole_rounds_take_the_steps_of_those_epochs(tmp_path):
    """10 prompts, rounds of 4 prompts (16 rows) of 2 optimizer steps, num_train_epochs=3. Rounds wrap around the
    epochs (an epoch's last round is filled from the next one's order), so 3 epochs = 30 prompts = 7.5 rounds =
    ceil(3 · 10 / 4 · 2) = 15 steps. It was ceil(3 · ceil(10 / 4) · 2) = 18 (3.6 epochs: the run overshot, stretched
    the schedule and fired a 4th on_epoch_end). Epochs end at steps 6 (12 prompts), 10 (20) and 15 (the stop)."""
    from transformers import TrainerCallback

    class Epochs(TrainerCallback):
        ends: list = []

        def on_epoch_end(self, args, state, control, **kwargs):
            self.ends.append(state.global_step)

    tokenizer = toy.build_tokenizer()
    args = small_args(tmp_path, max_steps=-1, num_train_epochs=3, steps_per_generation=2, logging_steps=5)
    trainer = GRPOTrainer(toy.build_model(tokenizer, hidden_size=16, num_layers=1), [toy.letter_reward], args=args,
                          train_dataset=toy.dataset(10), processing_class=tokenizer, callbacks=[Epochs])
    assert (trainer.max_steps, trainer.state.num_train_epochs) == (15, 3)
    trainer.train()
    assert trainer.global_step == 15 and Epochs.ends == [6, 10, 15]
    assert trainer.state.epoch == pytest.approx(3.0)


def test_a_checkpoint_planned_by_the_former_epoch_count_is_named_on_resume(tmp_path):
    """A run of num_train_epochs=3 over 10 prompts planned 18 steps before the epoch count was exact (15 now):
    resuming it re-planned silently (its schedule stretched to 15, or step 16 'not before max_steps=15'). The
    checkpoint is named with the max_steps that finishes it as planned; that max_steps, given, resumes."""
    from groupwise.checkpoint import CheckpointError
    from groupwise.checkpoint_load import check_resume

    state = {"global_step": 8, "world_size": 1, "max_steps": 18}
    derived = small_args(tmp_path, max_steps=-1, num_train_epochs=3)
    with pytest.raises(CheckpointError, match=r"planned for max_steps=18 by num_train_epochs=3.0 .* resume with "
                                              r"max_steps=18 to finish it as planned"):
        check_resume("ckpt", state, derived, world_size=1, max_steps=15, epoch_steps_before=18)
    check_resume("ckpt", {**state, "max_steps": 15}, derived, world_size=1, max_steps=15, epoch_steps_before=18)
    check_resume("ckpt", state, small_args(tmp_path, max_steps=18), world_size=1, max_steps=18, epoch_steps_before=18)
    # a checkpoint of the exact count ("epoch_plan") resumed with fewer epochs on purpose: not taken for an old one
    check_resume("ckpt", {**state, "epoch_plan": "passes"}, derived, world_size=1, max_steps=15, epoch_steps_before=18)


@pytest.mark.parametrize("optim, optim_args, key, want", [
    ("sgd", "momentum=0.9,nesterov=false", "nesterov", False),  # was the string 'false', which is truthy
    ("sgd", "momentum=0.9,nesterov=no", "nesterov", False),
    ("sgd", "momentum=0.9,nesterov=True", "nesterov", True),
    ("sgd", "momentum=0.9,nesterov=yes", "nesterov", True),
    ("rmsprop", "centered=false", "centered", False),
    ("rmsprop", "centered=TRUE", "centered", True),
    ("sgd", "momentum=0.5", "momentum", 0.5),
])
def test_optim_args_read_as_transformers_reads_them(optim, optim_args, key, want):
    """transformers' _get_sgd / _get_rmsprop: nesterov / centered = value.lower() in ('true', '1', 'yes')."""
    model = torch.nn.Linear(2, 2)
    ours = build_optimizer(model, _config(optim=optim, optim_args=optim_args))
    _, hf_kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir="u", optim=optim,
                                                                          optim_args=optim_args))
    assert ours.defaults[key] == want == hf_kwargs[key]


@pytest.mark.parametrize("optim, optim_args, field", [
    ("sgd", "momentum=0.9,weight_decay=0.1", "weight_decay"),
    ("adamw_torch", "lr=1e-3", "learning_rate"),
    ("adamw_torch_fused", "eps=1e-6", "adam_epsilon"),
    ("adamw_torch", "betas=0.9", "adam_beta1 / adam_beta2"),  # (a tuple cannot be written: "," splits items)
])
def test_optim_args_key_that_a_field_sets_is_refused_naming_the_field(optim, optim_args, field):
    """transformers ignores these in optim_args (the field's value applies); groupwise said 'got multiple values for
    keyword argument' after loading the model. Now one line at config time naming the field to set."""
    with pytest.raises(ConfigError) as info:
        _config(optim=optim, optim_args=optim_args)
    assert field in str(info.value) and "\n" not in str(info.value)
    _config(optim="adagrad", optim_args="eps=1e-6,lr_decay=0.1")  # eps is not a field for Adagrad: accepted


def test_eight_bit_optimizers_keep_embeddings_in_32_bits():
    """transformers' create_optimizer, optim_bits=8: every nn.Embedding's weight keeps 32-bit optimizer state
    (GlobalOptimManager override). Real bitsandbytes (its CPU backend): after one step the embedding's Adam moments
    are float32 where a Linear's of the same size are 8-bit codes (uint8); tensors under 4096 elements are 32-bit in
    bitsandbytes anyway, so both are 64 × 128."""
    bnb = pytest.importorskip("bitsandbytes")
    model = toy.build_model(toy.build_tokenizer(), hidden_size=128, num_layers=1)
    model.resize_token_embeddings(64)
    layer = model.model.layers[0].mlp.down_proj  # a Linear, 128 × intermediate
    for optim, eight_bit in (("adamw_8bit", True), ("paged_adamw_32bit", False)):
        optimizer = build_optimizer(model, _config(optim=optim))
        assert isinstance(optimizer, bnb.optim.optimizer.Optimizer2State)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        embed = optimizer.state[model.model.embed_tokens.weight]
        linear = optimizer.state[layer.weight]
        assert embed["state1"].dtype == embed["state2"].dtype == torch.float32
        assert linear["state1"].dtype == (torch.uint8 if eight_bit else torch.float32)


@pytest.mark.parametrize("name, kwargs, message", [
    ("linear", {"num_cycles": 2}, r"lr_scheduler_kwargs=\{'num_cycles': 2\} do not fit lr_scheduler_type='linear': "
                                  r".*unexpected keyword argument 'num_cycles'"),
    ("cosine_with_min_lr", None, r"do not fit lr_scheduler_type='cosine_with_min_lr': One of min_lr or min_lr_rate"),
    ("warmup_stable_decay", {}, r"do not fit lr_scheduler_type='warmup_stable_decay': .*'num_decay_steps'"),
    ("constant", {"num_cycles": 2}, r"lr_scheduler_type='constant' takes no lr_scheduler_kwargs \(transformers "
                                    r"would drop \['num_cycles'\]\)"),
])
def test_lr_scheduler_kwargs_that_do_not_fit_the_schedule_are_named_with_the_config(name, kwargs, message):
    """They failed when the trainer built the schedule, after the model had loaded (TRL: the same, late)."""
    with pytest.raises(ConfigError, match=message):
        _config(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs)
    fixed = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "warmup_stable_decay": {"num_decay_steps": 3}}.get(name)
    _config(lr_scheduler_type=name, lr_scheduler_kwargs=fixed)


def _reward_by_letters(completions, **_):
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.mark.parametrize("optim", sorted(__import__("groupwise.optim", fromlist=["OPTIMIZERS"]).OPTIMIZERS))
def test_every_optimizer_checkpoints_and_resumes_exactly(tmp_path, tokenizer, optim):
    """Each optim trains 3 steps with a checkpoint after each; a run resumed from checkpoint-1 ends with the straight
    run's weights, bit for bit. bitsandbytes' 8-bit optimizers keep their state tensors in a dict
    (`__bnb_optimizer_quant_state__`): the first checkpoint failed with "Object of type Tensor is not JSON
    serializable", so any run with save_steps or save_on_interrupt died at its first save."""
    from groupwise.optim import OPTIMIZERS

    if OPTIMIZERS[optim].requires:
        pytest.importorskip(OPTIMIZERS[optim].requires)

    def run(out, resume=None):
        args = small_args(tmp_path, output_dir=str(tmp_path / out), max_steps=3, save_steps=1, optim=optim,
                          learning_rate=1e-2)
        t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=64), [_reward_by_letters], args=args,
                        train_dataset=toy.dataset(12), processing_class=tokenizer)
        t.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in t.unwrapped.state_dict().items()}

    straight = run("straight")
    resumed = run("resumed", resume=str(tmp_path / "straight" / "checkpoint-1"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    start = toy.build_model(tokenizer, seed=0, hidden_size=64).state_dict()
    assert any(not torch.equal(straight[k], start[k]) for k in start)  # it trained


def test_optimizer_state_round_trips_nested_and_shared_tensors(tmp_path):
    """write_optimizer / read_optimizer by hand: plain per-parameter tensors keep their `state.<i>.<key>` names (the
    format of earlier checkpoints); a tensor in a nested dict goes to the file, named in the JSON; a tensor held in
    several places (across parameters, or a nested one that is also a top-level one) is written once and loads as
    one tensor again (safetensors refused the second copy)."""
    from safetensors.torch import load_file

    from groupwise.checkpoint_files import read_optimizer, write_optimizer

    qmap = torch.linspace(-1, 1, 5)
    exp_avg = torch.arange(6.0).reshape(2, 3)
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg, "quant": {"qmap": qmap, "bits": 8,
                                                                                   "inner": {"absmax": exp_avg}}},
                       1: {"step": 4, "quant": {"qmap": qmap, "state1": torch.ones(2, dtype=torch.uint8)}}},
             "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99], "params": [0, 1]}]}
    write_optimizer(state, tmp_path)
    assert sorted(load_file(str(tmp_path / "optimizer.safetensors"))) == [
        "nested.0.quant.0", "nested.1.quant.1", "state.0.exp_avg", "state.0.step"]  # qmap and exp_avg once
    back = read_optimizer(tmp_path)
    assert back["param_groups"] == state["param_groups"]
    zero, one = back["state"][0], back["state"][1]
    assert torch.equal(zero["step"], torch.tensor(3.0)) and torch.equal(zero["exp_avg"], exp_avg)
    assert zero["quant"]["bits"] == 8 and torch.equal(zero["quant"]["qmap"], qmap) and one["step"] == 4
    assert zero["quant"]["qmap"] is one["quant"]["qmap"]  # shared again
    assert zero["quant"]["inner"]["absmax"] is zero["exp_avg"]
    assert torch.equal(one["quant"]["state1"], torch.ones(2, dtype=torch.uint8))
