"""Unknown keys at any depth, did-you-mean, aliases, "auto", and accepted-unused keys."""

import logging

import pytest

from meshspeed.config import ACCEPTED_UNUSED, ConfigError, MeshspeedConfig, load_config
from meshspeed.config.keys import submodel
from tests.config.helpers import error_of


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"train_batch_szie": 8},
            "train_batch_szie: unknown key; did you mean 'train_batch_size'?",
        ),
        (
            {"zero_optimization": {"stgae": 3}},
            "zero_optimization.stgae: unknown key; did you mean 'stage'?",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
            "zero_optimization.offload_optimizer.devcie: unknown key; did you mean 'device'?",
        ),
        ({"fp16": {"enabeld": True}}, "fp16.enabeld: unknown key; did you mean 'enabled'?"),
        # a known-unused key is still a valid suggestion
        ({"tensorbord": {"enabled": True}}, "tensorbord: unknown key; did you mean 'tensorboard'?"),
    ],
)
def test_typo_names_full_path_and_closest_key(config, expected):
    assert error_of(config) == expected


def test_key_at_wrong_level_says_where_it_belongs():
    assert "'stage' is a key inside 'zero_optimization'" in error_of({"stage": 2})


def test_unrelated_key_in_small_section_lists_valid_keys():
    msg = error_of({"bf16": {"xyzzy": 1}})
    assert msg.startswith("bf16.xyzzy: unknown key")
    assert "valid keys here:" in msg and "enabled" in msg


def test_every_problem_reported_one_per_line():
    msg = error_of({"zero_optimization": {"stgae": 3, "stage": 9}, "fp16": {"enabeld": True}})
    lines = msg.splitlines()
    assert len(lines) == 3
    assert any(line.startswith("zero_optimization.stgae:") for line in lines)
    assert any(
        line.startswith("zero_optimization.stage: must be one of 0, 1, 2 or 3") for line in lines
    )
    assert any(line.startswith("fp16.enabeld:") for line in lines)


def test_known_unused_keys_accepted_and_logged_once(caplog):
    config = {
        "zero_allow_untested_optimizer": True,
        "comet": {"enabled": True, "anything": {"goes": [1, 2]}},
        "eigenvalue": {"enabled": False, "max_iter": 3},  # off: not reported
        "zero_optimization": {"stage": 2, "elastic_checkpoint": True},
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": False},  # asks nothing
        "bf16": {"enabled": False, "immediate_grad_update": True},  # block off: not reported
    }
    with caplog.at_level(logging.INFO, logger="meshspeed"):
        cfg = load_config(config)
    lines = [r.getMessage() for r in caplog.records if "accepted but not used" in r.getMessage()]
    assert lines == [("config keys accepted but not used by meshspeed yet: "
                     "zero_allow_untested_optimizer, zero_optimization.elastic_checkpoint")]
    monitors = [r.getMessage() for r in caplog.records if "monitors" in r.getMessage()]
    assert len(monitors) == 1 and "comet" in monitors[0] and "eigenvalue" not in monitors[0]
    assert cfg.zero_stage == 2 and cfg.fp16.enabled
    assert "comet" in cfg.ignored_keys
    assert "comet" not in cfg.to_dict()


@pytest.mark.parametrize("config, says", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "ZeRO++ non-trainable"),
    ({"quantize_training": {"enabled": True}}, "quantization-aware training"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16 optimizer states"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "gradient accumulation dtype"),
])
def test_a_key_asking_for_a_missing_parallelism_or_numerics_is_an_error(config, says):
    with pytest.raises(ConfigError, match="which meshspeed does not implement yet") as err:
        load_config(config)
    assert says in str(err.value)


@pytest.mark.parametrize("config", [
    {"sequence_parallel_size": 1},
    {"tensor_parallel": {"autotp_size": 1}},
    {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False}},
    {"hybrid_engine": {"enabled": False, "max_out_tokens": 512}},
    {"data_types": {"grad_accum_dtype": "fp32"}},
])
def test_the_same_keys_at_their_defaults_are_accepted(config):
    load_config(config)


def test_no_log_line_without_unused_keys(caplog):
    with caplog.at_level(logging.INFO, logger="meshspeed"):
        load_config({"train_micro_batch_size_per_gpu": 2})
    assert not [r for r in caplog.records if "accepted but not used" in r.getMessage()]


def _typed_paths(model, prefix=""):
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        yield path
        sub = submodel(info.annotation)
        if sub is not None:
            yield from _typed_paths(sub, path)


def test_accepted_unused_list_does_not_shadow_typed_fields():
    # When a feature lands its key moves from known_keys.py to a model: never both.
    assert not ACCEPTED_UNUSED & set(_typed_paths(MeshspeedConfig))


def test_auto_means_the_default_except_in_the_free_form_params():
    """Note ["auto" values]: what Hugging Face left "auto" takes the default, as in
    DeepSpeed's typed sections; optimizer / scheduler params are handed on as written."""
    msg = error_of(
        {"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    )
    assert msg.splitlines() == [
        'optimizer.params.lr: "auto" was not filled in; DeepSpeed hands optimizer and scheduler '
        "params to the optimizer as written, so give a number"]
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                       "gradient_clipping": "auto",
                       "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                             "stage3_prefetch_bucket_size": "auto"}}, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_clipping) == (8, 0.0)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000


def test_aliases_rename_and_conflicts_are_errors():
    cfg = load_config(
        {
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "stage3_gather_fp16_weights_on_model_save": True,
                "max_live_parameters": 5e6,
            },
            "aio": {"intra_op_parallelism": 4},
        }
    )
    assert cfg.bf16.enabled
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert cfg.zero_optimization.stage3_max_live_parameters == 5_000_000
    assert cfg.aio.thread_count == 4
    msg = error_of({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert msg == "bf16: same setting as 'bfloat16' with a different value; give only one of them"


def test_legacy_cpu_offload_becomes_offload_optimizer():
    cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    cfg = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert cfg.zero_optimization.offload_optimizer is None


def test_judged_keys_are_accepted_unused_keys():
    from meshspeed.config.unbuilt import ASKS, MONITORS

    assert set(ASKS) | set(MONITORS) <= ACCEPTED_UNUSED
