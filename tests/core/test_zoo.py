"""The zoo against published parameter counts and FLOPs, and the profiles it makes."""

import pytest

from commsched.costmodel.profile import Profile
from commsched.costmodel.zoo import (
    ADAM_BYTES_PER_PARAM,
    DEVICES,
    MODELS,
    get_model,
    list_devices,
    list_models,
    zoo_profile,
)

pytestmark = pytest.mark.timeout(60)

# Published totals: torchvision's model cards, Devlin et al. (BERT-large "340M", 335 M in
# the reference implementation), GPT-2 XL "1.5B" (1,557,611,200 in Hugging Face), Llama 2
# 7B (6,738,415,616 in Hugging Face) and 70B ("69B").
PUBLISHED = {"resnet50": 25.6e6, "vgg16": 138.4e6, "gpt2-xl": 1.558e9, "gpt-7b": 6.74e9, "gpt-70b": 69.0e9}


@pytest.mark.parametrize("model, published", sorted(PUBLISHED.items()))
def test_parameter_counts_match_the_published_ones_within_two_percent(model, published):
    assert zoo_profile(model).meta["params"] == pytest.approx(published, rel=0.02)
    assert sum(t.numel for layer in zoo_profile(model).layers for t in layer.tensors) == get_model(model).params


def test_bert_large_has_between_335_and_340_million_parameters():
    assert 335e6 <= get_model("bert-large").params <= 340e6


@pytest.mark.parametrize("model, exact", [("resnet50", 25_557_032), ("vgg16", 138_357_544),
                                          ("gpt2-xl", 1_557_611_200), ("gpt-7b", 6_738_415_616)])
def test_parameter_counts_equal_the_reference_implementations_exactly(model, exact):
    # torchvision resnet50 / vgg16, Hugging Face gpt2-xl and Llama-2-7b-hf
    assert get_model(model).params == exact


@pytest.mark.parametrize("model, published_gflops", [("resnet50", 2 * 4.09), ("vgg16", 2 * 15.47)])
def test_cnn_forward_flops_match_the_published_multiply_adds(model, published_gflops):
    # published as GMACs at 224×224 (ResNet-50 4.09, VGG-16 15.47); a multiply-add is 2 FLOPs
    assert get_model(model).forward_flops() == pytest.approx(published_gflops * 1e9, rel=0.03)


@pytest.mark.parametrize("model", ["gpt2-xl", "gpt-7b", "gpt-70b"])
def test_decoder_training_flops_are_six_n_tokens_within_fifteen_percent(model):
    peak = DEVICES["h100"].peak_flops["bf16"]
    profile = zoo_profile(model, "h100", efficiency=1.0, batch_size=2)
    tokens = 2 * profile.meta["seq_len"]
    flops = (profile.forward_s + profile.backward_s) * peak
    assert flops == pytest.approx(6 * profile.meta["params"] * tokens, rel=0.15)
    assert flops > 6 * (profile.meta["params"] - get_model(model).layers[0].params) * tokens  # + attention


def test_layer_times_follow_flops_peak_and_efficiency_and_backward_is_twice_forward():
    spec = get_model("gpt-7b")
    profile = zoo_profile("gpt-7b", "a100", batch_size=3, seq_len=1024, efficiency=0.5)
    block = next(layer for layer in profile.layers if layer.name == "layers.5")
    zoo_block = next(layer for layer in spec.layers if layer.name == "layers.5")
    assert block.forward_s == pytest.approx(spec.layer_forward_flops(zoo_block, 1024) * 3 / (312e12 * 0.5))
    for layer in profile.layers:
        assert layer.backward_s == pytest.approx(2 * layer.forward_s)
    assert profile.apply_s == pytest.approx(spec.params * ADAM_BYTES_PER_PARAM / 2.039e12)
    slower = zoo_profile("gpt-7b", "a100", batch_size=3, seq_len=1024, efficiency=0.25)
    assert slower.forward_s == pytest.approx(2 * profile.forward_s)
    assert zoo_profile("gpt-7b", "h200").apply_s < zoo_profile("gpt-7b", "h100").apply_s


def test_gradient_element_size_follows_the_dtype():
    assert {t.element_size for layer in zoo_profile("resnet50").layers for t in layer.tensors} == {2}
    fp32 = zoo_profile("resnet50", dtype="fp32")
    assert fp32.grad_bytes == 4 * get_model("resnet50").params
    assert zoo_profile("gpt-70b").grad_bytes == 2 * get_model("gpt-70b").params  # 138 GB of bf16


def test_tensor_and_pipeline_parallel_shards_divide_bytes_and_compute():
    whole = zoo_profile("gpt-70b")
    shard = zoo_profile("gpt-70b", tp=8, pp=2)
    assert shard.grad_bytes == pytest.approx(whole.grad_bytes / 16, rel=1e-3)
    assert shard.forward_s == pytest.approx(whole.forward_s / 16)
    assert shard.apply_s == pytest.approx(whole.apply_s / 16)
    assert shard.source == whole.source == "zoo:gpt-70b@h100"
    assert (shard.meta["tp"], shard.meta["pp"]) == (8, 2)


def test_layers_are_in_forward_order_so_the_last_layer_is_ready_first():
    profile = zoo_profile("bert-large")
    assert profile.layers[0].name == "embed" and profile.layers[-1].name == "final"
    ready = profile.ready_times()
    assert ready == sorted(ready, reverse=True)
    assert ready[0] == pytest.approx(profile.backward_s)


@pytest.mark.parametrize("model", ["resnet50", "gpt-7b"])
def test_a_zoo_profile_round_trips_through_profile_json(tmp_path, model):
    profile = zoo_profile(model, "h200", tp=2)
    path = tmp_path / "profile.json"
    profile.to_json(str(path))
    assert Profile.from_json(str(path)) == profile


def test_the_zoo_lists_the_models_and_devices_the_issue_names():
    assert {"resnet50", "vgg16", "bert-large", "gpt2-xl", "gpt-7b", "gpt-70b"} <= set(list_models())
    assert {"h100", "h200", "a100", "v100", "cpu"} <= set(list_devices())
    assert set(list_models()) == set(MODELS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="gpt-8b"), "gpt-70b"), (dict(model="resnet50", device="tpu"), "h100"),
    (dict(model="resnet50", device="v100"), "fp16"), (dict(model="resnet50", dtype="int8"), "bf16"),
    (dict(model="resnet50", efficiency=1.5), "efficiency"), (dict(model="resnet50", efficiency=0), "efficiency"),
    (dict(model="resnet50", seq_len=128), "no seq_len"), (dict(model="gpt-7b", batch_size=0), "batch_size"),
    (dict(model="gpt-7b", tp=0), "tp"), (dict(model="gpt-7b", pp=1.5), "pp"),
])
def test_bad_arguments_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zoo_profile(**kwargs)


def test_v100_trains_in_fp16():
    profile = zoo_profile("bert-large", "v100", dtype="fp16")
    assert profile.source == "zoo:bert-large@v100" and profile.forward_s > zoo_profile("bert-large", "h100").forward_s
