import warnings

import pytest

from groupwise import ConfigError, GRPOConfig
from groupwise.config import TRL_NOT_SUPPORTED


@pytest.mark.parametrize("kwargs, match", [
    (dict(per_device_train_batch_size=6, num_generations=4), r"divisible by num_generations=4"),
    (dict(num_generations=1), r"num_generations must be ≥ 2"),
    (dict(loss_type="ppo"), r"loss_type='ppo' is not one of"),
    (dict(epsilon=0.0), r"epsilon must be > 0"),
    (dict(scale_rewards="grp"), r"scale_rewards='grp'"),
    (dict(importance_sampling_level="seq"), r"importance_sampling_level"),
    (dict(delta=1.1), r"delta must be > 1 \+ epsilon_high"),
    (dict(top_entropy_quantile=-0.1), r"top_entropy_quantile"),
    (dict(seed=-1), r"seed must be in \[0, 4294967295\], got -1"),
    (dict(data_seed=2**32), r"data_seed must be in \[0, 4294967295\]"),
    (dict(logging_steps=0), r"logging_strategy='steps' needs logging_steps > 0 .*or logging_strategy='no'"),
    (dict(sync_ref_model=True), r"needs beta > 0"),
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), r"multiple of\s+gradient_accumulation_steps"),
    (dict(learning_rate="fast"), r"learning_rate='fast' must be of type float"),
    (dict(max_steps=2.5), r"max_steps=2.5 must be of type int"),
    (dict(reward_std="sample"), r"reward_std='sample'"),
    (dict(report_to="mlflow"), r"report_to='mlflow'"),
    (dict(generation_kwargs=[1, 2]), r"generation_kwargs=\[1, 2\] must be of type dict"),
    (dict(model_init_kwargs='{"dtype": bf16}'), r"model_init_kwargs='.*' is not valid JSON: Expecting value"),
])
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_yaml_merge_keys_may_override_and_a_repeated_key_is_refused():
    from groupwise.config_base import read_yaml

    assert read_yaml("base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  a: 3\n")["x"] == {"a": 3, "b": 2}
    # a mapping that merges and overrides, itself merged by a shallower one (PyYAML flattens it in place first)
    # (it was refused as a repeated key; read as PyYAML reads it)
    import yaml

    text = "a: &a {k: 1}\nb:\n  c: &c {<<: *a, k: 2}\nd: {<<: *c}\n"
    assert read_yaml(text) == yaml.safe_load(text) and read_yaml(text)["b"]["c"] == {"k": 2}
    assert read_yaml("x: &x {a: 1}\ny: &y {a: 2, b: 1}\nz: {<<: [*x, *y]}\n")["z"] == {"a": 1, "b": 1}
    with pytest.raises(Exception, match=r"the key 'a' is given twice \(lines 2 and 3\): keep one"):
        read_yaml("x:\n  a: 1\n  a: 2\n")


def test_unknown_and_unsupported_fields():
    with pytest.raises(ConfigError, match=r"unknown field 'num_generation'; did you mean 'num_generations'"):
        GRPOConfig(num_generation=4)
    # a match of the same family first: 'local_rank' is closer by letters, 'lora_r' is what was meant
    with pytest.raises(ConfigError, match=r"unknown field 'lora_rank'; did you mean 'lora_r'\?"):
        GRPOConfig(lora_rank=4)
    with pytest.raises(ConfigError, match=r"TRL field use_liger_kernel=True is not supported.*Liger"):
        GRPOConfig(use_liger_kernel=True)
    assert "use_liger_loss" in TRL_NOT_SUPPORTED


def test_trl_spellings_and_coercion():
    c = GRPOConfig(scale_rewards=False, learning_rate="1e-3", report_to="none", epsilon_high=0.28)
    assert c.scale_rewards == "none" and c.learning_rate == 1e-3 and c.report_to == []
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    # dict fields as JSON text, from the command line (TRL parses them too)
    c = GRPOConfig(generation_backend="transformers", generation_kwargs='{"top_k": 5}',
                   chat_template_kwargs=' {"enable_thinking": false}')
    assert c.generation_kwargs == {"top_k": 5} and c.chat_template_kwargs == {"enable_thinking": False}
    # 'true' / 'false' as text (a quoted YAML value, a script's argparse) are booleans where a field takes one
    c = GRPOConfig(resume_from_checkpoint="True", bf16=" false", scale_rewards="TRUE")
    assert c.resume_from_checkpoint is True and c.bf16 is False and c.scale_rewards == "group"
    assert GRPOConfig(resume_from_checkpoint="out/checkpoint-5").resume_from_checkpoint == "out/checkpoint-5"
    # a boolean-only field reads transformers' string_to_bool words too, as TRL's parser reads a config's values;
    # a field that also takes text keeps them as text (a folder named "yes")
    assert GRPOConfig(bf16="yes").bf16 is True and GRPOConfig(bf16="0").bf16 is False
    assert GRPOConfig(resume_from_checkpoint="yes").resume_from_checkpoint == "yes"
    with pytest.raises(ConfigError, match="bf16='maybe' must be of type bool"):
        GRPOConfig(bf16="maybe")
    # report_to: None is no tracker, 'all' every installed one (transformers)
    from groupwise.trackers import installed_trackers

    assert GRPOConfig(report_to=None).report_to == [] and GRPOConfig(report_to="all").report_to == installed_trackers()


def test_layout_counts_completions_like_trl(monkeypatch):
    # 2 processes × 4 completions × steps_per_generation 3 = 24 completions = 6 prompts of G = 4
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, steps_per_generation=3)
    lay = c.layout(world_size=2)
    assert (lay.generation_batch_size, lay.prompts_per_generation, lay.local_rows) == (24, 6, 12)
    with pytest.raises(ConfigError, match="divisible"):
        GRPOConfig(per_device_train_batch_size=2, num_generations=4, steps_per_generation=1).layout(world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: 2 × 2 completions = one group of 4
    assert GRPOConfig(per_device_train_batch_size=2, num_generations=4).layout(world_size=2).prompts_per_generation == 1


@pytest.mark.parametrize("given", [{}, dict(steps_per_generation=4), dict(generation_batch_size=24),
                                   dict(steps_per_generation=2, generation_batch_size=12)])
def test_round_fields_are_filled_in_as_trl_fills_them(given):
    # per_device 6 × 1 process; gradient_accumulation_steps 2: neither given → steps 2, batch 6 × 2 = 12;
    # steps 4 → batch 24; batch 24 → steps 24 / 6 = 4; both given and agreeing → kept
    kw = dict(per_device_train_batch_size=6, num_generations=3, gradient_accumulation_steps=2, **given)
    ours = GRPOConfig(**kw)
    expected = {(): (2, 12), ("steps_per_generation",): (4, 24), ("generation_batch_size",): (4, 24),
                ("steps_per_generation", "generation_batch_size"): (2, 12)}[tuple(given)]
    assert (ours.steps_per_generation, ours.generation_batch_size) == expected
    trl = pytest.importorskip("trl")
    if len(given) < 2:  # TRL refuses both at once; a dump of its own carries both
        theirs = trl.GRPOConfig(output_dir="unused", report_to="none", bf16=False, **kw)
        assert (theirs.steps_per_generation, theirs.generation_batch_size) == expected


def test_filled_round_fields_follow_the_real_process_count_and_later_edits():
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2)
    assert (c.steps_per_generation, c.generation_batch_size) == (2, 8)  # filled for 1 process
    # the trainer's 2 processes: derived again, 4 × 2 × 2 = 16 (not a disagreement with the 8 filled for 1)
    assert c.layout(world_size=2).generation_batch_size == 16 and c.generation_batch_size == 16
    c.steps_per_generation = 4  # set after construction: now the user's value, the batch follows it
    assert (c.layout(world_size=1).generation_batch_size, c.generation_batch_size) == (16, 16)
    import dataclasses

    # a copy carries both filled-in values as given: a one-line error that names the way out
    with pytest.raises(ConfigError, match=r"disagree .*dataclasses.replace .*pass steps_per_generation=None, "
                                          r"generation_batch_size=None with the change"):
        dataclasses.replace(c, per_device_train_batch_size=8)
    copy = dataclasses.replace(c, per_device_train_batch_size=8, steps_per_generation=None, generation_batch_size=None)
    assert (copy.steps_per_generation, copy.generation_batch_size) == (2, 16)
    b = GRPOConfig(per_device_train_batch_size=4, num_generations=4, generation_batch_size=16)
    assert b.layout(world_size=2).steps_per_generation == 2 and b.steps_per_generation == 2  # 16 / (4 × 2)


def test_yaml_round_trip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("num_generations: 4\nper_device_train_batch_size: 8\nlearning_rate: 1e-5\nloss_type: grpo\n")
    c = GRPOConfig.from_yaml(str(p))
    assert (c.num_generations, c.learning_rate, c.loss_type) == (4, 1e-5, "grpo")
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        GRPOConfig.from_yaml(str(p))


def test_missing_prompt_column_is_caught_before_the_model_loads(tmp_path):
    from groupwise import GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2)
    # the model path does not exist: the dataset error must come first
    with pytest.raises(ValueError, match="no 'prompt' column"):
        GRPOTrainer("no/such/model", lambda completions, **_: [0.0] * len(completions), args=args,
                    train_dataset=[{"question": "1+1"}])
    with pytest.raises(ValueError, match="reward_weights has 2 entries for 1"):
        GRPOTrainer("no/such/model", lambda completions, **_: [0.0], train_dataset=[{"prompt": "x"}],
                    args=GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                                    reward_weights=[1.0, 2.0]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(learning_rate=float("nan")), r"learning_rate must be a finite number, got nan"),
    (dict(beta=float("inf")), r"beta must be a finite number"),
    (dict(temperature="nan"), r"temperature must be a finite number"),  # as typed on the command line
    (dict(max_grad_norm=float("-inf")), r"max_grad_norm must be a finite number"),
    (dict(max_steps=-5), r"max_steps must be ≥ -1, got -5"),
    (dict(max_steps=0, num_train_epochs=0), r"num_train_epochs=0 with max_steps ≤ 0: nothing to train"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(adam_beta2=1.0), r"adam_beta2 must be in \[0, 1\), got 1.0"),
    (dict(advantage_estimator="ppo"), r"advantage_estimator='ppo' is not one of \['grpo', 'rloo', 'reinforce_plus_plus_baseline'\]"),
    (dict(generation_backend="vllm"), r"generation_backend='vllm' with use_vllm=False: vLLM is selected with use_vllm=True "
                                     r".*set use_vllm=True, or generation_backend='fast'"),
    (dict(generation_backend="sglang"), r"generation_backend='sglang' is not one of \['fast', 'transformers', 'vllm'\]"),
    (dict(generation_backend="transformers", generation_compile=True), r"generation_compile=True applies to generation_backend=.fast."),
    (dict(generation_compile=False, generation_fuse_projections=True), r"generation_fuse_projections applies to the fast backend's static decode loop"),
    (dict(step_split="regex"), r"step_split='regex' needs step_pattern"),
    (dict(reward_weights=[1.0, float("nan")]), r"reward_weights must be a list of finite numbers"),
    (dict(loss_type="vespo", generation_dtype="bfloat16"),  # the default mode is sequence_mask
     r"loss_type='vespo' folds the sampler correction .* set vllm_importance_sampling_mode to 'token_truncate'"),
    (dict(vespo_k_pos=1.0), r"vespo_k_pos=1.0 has no effect with loss_type='dapo'.*\['vespo'\]"),
    (dict(vespo_lambda_neg=-1.0), r"vespo_lambda_neg must be ≥ 0"),
    (dict(off_policy_mask_threshold=-0.1), r"off_policy_mask_threshold must be ≥ 0"),
    (dict(entropy_target=0.5), r"entropy_target=0.5 has no effect without use_adaptive_entropy=True"),
    (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.2),
     r"entropy_coef_min \(0.5\) must not exceed entropy_coef_max \(0.2\)"),
])
def test_declared_constraints_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_choices_come_from_the_registries():
    """Every list of choices has one source: the registry the value is looked up in."""
    import dataclasses

    from groupwise.core.advantages import ESTIMATORS
    from groupwise.core.losses import LOSS_TYPES
    from groupwise.core.supervision import SUPERVISIONS
    from groupwise.optim import OPTIMIZERS
    from groupwise.generation import BACKENDS
    from groupwise.rewards.steps import SPLIT_MODES

    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(GRPOConfig)}
    assert choices["advantage_estimator"] is ESTIMATORS and choices["loss_type"] is LOSS_TYPES
    assert choices["supervision"] is SUPERVISIONS and choices["generation_backend"] is BACKENDS
    assert choices["step_split"] is SPLIT_MODES and choices["optim"] is OPTIMIZERS


def test_import_groupwise_stays_light():
    """`import groupwise` and building a config import neither transformers nor an optional backend; telling
    plain rows from a datasets.IterableDataset does not import datasets (~1 s)."""
    import subprocess
    import sys

    code = ("import sys, groupwise; groupwise.GRPOConfig(); from groupwise.data import is_stream; "
            "assert not is_stream([{'prompt': 'a'}]) and is_stream(iter([])); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate', 'datasets', "
            "'vllm', 'peft', 'wandb', 'deepspeed', 'tensorboard'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"report_to='wandb' needs `pip install groupwise\[wandb\]`"):
        GRPOConfig(report_to=["wandb"])
    assert GRPOConfig(report_to="none").report_to == []


def test_importance_sampling_bounds_checked_on_construction():
    # TRL 1.16 refuses both at construction: every weight would be masked (or clamped to one value), or a
    # truncate mode would clip nothing
    with pytest.raises(ConfigError, match=r"vllm_importance_sampling_clip_min \(3.0\) must be less than "
                                          r"vllm_importance_sampling_clip_max \(3.0\)"):
        GRPOConfig(output_dir="o", vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ConfigError, match="'token_truncate' clips the weights: set vllm_importance_sampling_clip_min"):
        GRPOConfig(output_dir="o", vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=None)
    GRPOConfig(output_dir="o", vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None)
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        assert GRPOConfig(output_dir="o", vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0


def test_scale_rewards_with_normalize_then_sum_is_refused_only_where_it_has_no_effect():
    # normalize_then_sum fixes the outcome rewards' scale ('batch'); step rewards still read scale_rewards
    with pytest.raises(ConfigError, match=r"scale_rewards='none' has no effect with multi_objective_aggregation="):
        GRPOConfig(supervision="outcome", multi_objective_aggregation="normalize_then_sum", scale_rewards="none")
    c = GRPOConfig(supervision="both", multi_objective_aggregation="normalize_then_sum", scale_rewards="none")
    assert c.estimator_options()["scale"] == "none" and c.estimator_options(outcome=True)["scale"] == "batch"


def test_vllm_model_impl_takes_vllms_values():
    # TRL passes the field to vLLM, whose model_impl also takes 'auto' (TRL's VLLMGeneration default) and 'terratorch'
    assert GRPOConfig(output_dir="o", vllm_model_impl="auto").vllm_model_impl == "auto"
    GRPOConfig(output_dir="o", vllm_model_impl="terratorch")
    with pytest.raises(ConfigError, match="vllm_model_impl"):
        GRPOConfig(output_dir="o", vllm_model_impl="hf")


def test_normalize_then_sum_under_process_supervision_is_refused():
    """It combines reward_funcs, which supervision 'process' only logs; several step-reward functions were summed
    as they were (100 and 1 on two functions' steps gave 100 and 1), which the setting seemed to promise otherwise."""
    with pytest.raises(ConfigError, match=r"multi_objective_aggregation='normalize_then_sum' combines the outcome "
                                          r"rewards \(reward_funcs\), which supervision='process' only logs: its "
                                          r"step rewards are summed with process_reward_weights"):
        GRPOConfig(supervision="process", multi_objective_aggregation="normalize_then_sum")
    # under 'both' it z-scores the outcome functions; two step functions are summed as they are: a warning says so
    from groupwise.loading import check_inputs

    args = GRPOConfig(output_dir="o", supervision="both", multi_objective_aggregation="normalize_then_sum")

    def steps(steps, **_):
        return [[1.0] * len(row) for row in steps]

    with pytest.warns(UserWarning, match=r"the 2 step-reward sources are summed with process_reward_weights as they "
                                         r"are \(not z-scored\)"):
        check_inputs(args, "x", [lambda completions, **_: [0.0] * len(completions)], [steps, steps])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # one step function: nothing to put on one scale
        check_inputs(args, "x", [lambda completions, **_: [0.0] * len(completions)], [steps])
        weighed = GRPOConfig(output_dir="o", supervision="both", multi_objective_aggregation="normalize_then_sum",
                             process_reward_weights=[1.0, 0.01])  # the fix the warning names: nothing more to say
        check_inputs(weighed, "x", [lambda completions, **_: [0.0] * len(completions)], [steps, steps])


def test_transformers_readings_of_output_dir_eval_steps_and_checkpointing_none(monkeypatch, tmp_path):
    """`~` in output_dir is the home folder (it made a folder named `~` in the working directory); eval_steps falls
    back to logging_steps only under eval_strategy='steps' (it was 10 with evaluation off, in to_dict() and the
    trackers' config); `--activation_checkpointing None` is unset (it was refused naming gradient_checkpointing);
    top_entropy_quantile=0 keeps the highest-entropy tokens, as TRL accepts it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert GRPOConfig(output_dir="~/runs/x").output_dir == str(tmp_path / "runs" / "x")
    assert GRPOConfig().eval_steps is None and GRPOConfig(eval_strategy="steps").eval_steps == 10
    c = GRPOConfig(activation_checkpointing="None", gradient_checkpointing=True)
    assert c.gradient_checkpointing is True and c.activation_checkpointing is True
    assert GRPOConfig(top_entropy_quantile=0.0).top_entropy_quantile == 0.0


def test_values_a_dumped_trl_config_holds_load():
    """TRL accepts them (transformers' readings): learning_rate 0, epsilon ≥ 1 (no lower clip), max_steps 0 (train
    by epochs), num_train_epochs 0 beside max_steps, eval_steps 0 under eval_strategy='steps' (logging_steps)."""
    assert GRPOConfig(learning_rate=0.0, epsilon=1.5).epsilon == 1.5
    assert GRPOConfig(max_steps=0).max_steps == 0 and GRPOConfig(max_steps=5, num_train_epochs=0).max_steps == 5
    assert GRPOConfig(eval_strategy="steps", eval_steps=0, logging_steps=4).eval_steps == 4


def test_trls_warnings_on_the_importance_sampling_level_of_a_loss_type():
    """TRL warns when luspo runs with token-level ratios (its paper's setup is sequence-level), and when a
    sequence-level ratio meets a loss that sums per-token terms (bnpo, dr_grpo, dapo, cispo: length-weighted)."""
    import warnings

    with pytest.warns(UserWarning, match=r"loss_type='luspo' is set up with importance_sampling_level='sequence'"):
        GRPOConfig(loss_type="luspo")
    for loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
        kw = {"epsilon_high": 0.3} if loss == "cispo" else {}
        with pytest.warns(UserWarning, match=rf"importance_sampling_level='sequence' with loss_type='{loss}'"):
            GRPOConfig(loss_type=loss, importance_sampling_level="sequence", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(loss_type="luspo", importance_sampling_level="sequence")
        GRPOConfig(loss_type="grpo", importance_sampling_level="sequence")


def test_tr_dpo_fields_without_sync_ref_model_and_step_fields_of_other_strategies():
    """ref_model_mixup_alpha / ref_model_sync_steps set without sync_ref_model are an error (as the adaptive-entropy
    fields; they were accepted without effect); a fractional save_steps under save_strategy='no' loads (transformers
    checks it under 'steps' only: a TRL dump with save_strategy no, save_steps 1.5 failed); a negative
    num_completions_to_print is refused (it printed nothing)."""
    with pytest.raises(ConfigError, match=r"ref_model_mixup_alpha=0.9 has no effect without sync_ref_model=True"):
        GRPOConfig(ref_model_mixup_alpha=0.9)
    with pytest.raises(ConfigError, match=r"ref_model_sync_steps=8 has no effect without sync_ref_model=True"):
        GRPOConfig(ref_model_sync_steps=8)
    GRPOConfig(save_strategy="no", save_steps=1.5)
    with pytest.raises(ConfigError, match=r"save_steps=1.5 must be a whole number of steps"):
        GRPOConfig(save_steps=1.5)
    with pytest.raises(ConfigError, match=r"num_completions_to_print must be ≥ 0"):
        GRPOConfig(num_completions_to_print=-1)


def test_config_warnings_point_at_the_users_line():
    """A warning of GRPOConfig's checks names the line that built the config (this file), not groupwise's code,
    through the dataclass's generated __init__ and any depth of validation."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(output_dir="/tmp/unused", loss_type="dr_grpo", importance_sampling_level="sequence")
        GRPOConfig(output_dir="/tmp/unused", use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.5)
        GRPOConfig(output_dir="/tmp/unused", dataloader_num_workers=2)  # an inert field
    assert len(caught) >= 3
    assert {w.filename for w in caught} == {__file__}, [(w.filename, str(w.message)[:60]) for w in caught]


def test_fields_that_need_a_switch_that_is_off_are_warned_about():
    """gradient_checkpointing_kwargs without gradient_checkpointing, and the vLLM engine's fields without use_vllm,
    did nothing, with nothing said (TRL ignores them too); at their defaults (a TRL config's dump) nothing is said."""
    with pytest.warns(UserWarning, match=r"^gradient_checkpointing_kwargs=\{'use_reentrant': False\}: no effect "
                                         r"without gradient_checkpointing=True \(activations are kept"):
        GRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match=r"^vllm_gpu_memory_utilization=0\.5, vllm_enable_sleep_mode=True: no effect "
                                         r"without use_vllm=True \(they configure the vLLM engine"):
        GRPOConfig(vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig()
        GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        GRPOConfig(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})
