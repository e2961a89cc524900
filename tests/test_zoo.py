"""The model zoo: exact parameter and tensor counts, forward order, tied weights, FLOP-based times."""
import json
import math

import pytest
import torch
from torch import nn

from gradsync import ConfigError, ModelProfile
from gradsync.profile import zoo, zoo_names
from gradsync.profile.devices import DEVICES
from gradsync.profile.model_zoo import forward_layers

TERAFLOP = 1e12  # a custom device: time = FLOPs / 1e12, no launch overhead


def bert_pretraining_parameters(hidden, layers, intermediate, vocab=30522, positions=512, types=2):
    """BERT pre-training parameters from its layer shapes; the MLM decoder reuses the word embedding."""
    embeddings = (vocab + positions + types) * hidden + 2 * hidden  # three tables + LayerNorm
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden  # Q, K, V, output dense + LayerNorm
    feed_forward = 2 * hidden * intermediate + intermediate + hidden + 2 * hidden  # two dense + LayerNorm
    pooler = hidden * hidden + hidden
    mlm_head = hidden * hidden + hidden + 2 * hidden + vocab  # transform dense, LayerNorm, decoder bias
    nsp_head = 2 * hidden + 2
    return embeddings + layers * (attention + feed_forward) + pooler + mlm_head + nsp_head


# (parameters, gradient tensors). Parameters: torchvision's models (the counts its docs list) and
# the BERT formula above. Tensors: one per conv weight (no bias), two per batch norm and linear.
EXPECTED_COUNTS = {
    "resnet50": (25_557_032, 53 + 2 * 53 + 2),  # 53 convs, 53 BNs, fc
    "resnet152": (60_192_808, 155 + 2 * 155 + 2),  # asc-wfbp Table III: 467 tensors
    "vgg16": (138_357_544, 2 * 13 + 2 * 3),  # 13 convs and 3 linears, all with bias
    "densenet201": (20_013_928, 200 + 2 * 201 + 2),  # asc-wfbp Table III: 604; 2x98 + 3 + 1 convs
    "mobilenet_v2": (3_504_872, 52 + 2 * 52 + 2),  # 52 convs, 52 BNs, classifier
    "googlenet": (6_624_904, 3 * 57 + 2),  # 3 stem + 9 x 6 conv-BN units, fc; no aux heads
    "inception_v3": (27_161_264, 3 * 96 + 2 * 2),  # 96 conv-BN units, fc and aux fc
    "bert_base": (110_106_428, 5 + 16 * 12 + 2 + 4 + 1 + 2),  # asc-wfbp Table III: 206 tensors
    "bert_large": (336_226_108, 5 + 16 * 24 + 2 + 4 + 1 + 2),
}

FIRST_AND_LAST_LAYERS = {
    "resnet50": ("conv1", "fc"),
    "resnet152": ("conv1", "fc"),
    "vgg16": ("features.0", "classifier.6"),
    "densenet201": ("features.conv0", "classifier"),
    "mobilenet_v2": ("features.0.0", "classifier.1"),
    "googlenet": ("conv1.conv", "fc"),
    "inception_v3": ("Conv2d_1a_3x3.conv", "fc"),
    "bert_base": ("bert.embeddings.word_embeddings", "cls.seq_relationship"),
    "bert_large": ("bert.embeddings.word_embeddings", "cls.seq_relationship"),
}


def layer_names(profile):
    return [layer.name for layer in profile.layers]


def test_zoo_names_are_the_papers_models():
    assert zoo_names() == sorted(EXPECTED_COUNTS)


def test_bert_formula_gives_the_reference_counts():
    assert bert_pretraining_parameters(768, 12, 3072) == 110_106_428
    assert bert_pretraining_parameters(1024, 24, 4096) == 336_226_108


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_parameter_and_tensor_counts(name):
    profile = zoo(name)
    assert (profile.num_parameters, profile.num_tensors) == EXPECTED_COUNTS[name]
    assert profile.total_bytes == 4 * profile.num_parameters  # fp32


@pytest.mark.parametrize("name", sorted(FIRST_AND_LAST_LAYERS))
def test_layers_run_from_input_to_output(name):
    names = layer_names(zoo(name))
    assert (names[0], names[-1]) == FIRST_AND_LAST_LAYERS[name]


def test_order_inside_models_follows_execution():
    resnet = layer_names(zoo("resnet50"))
    assert resnet[:4] == ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1"]
    assert resnet.index("layer1.0.bn3") + 1 == resnet.index("layer1.0.downsample.0")
    inception = layer_names(zoo("inception_v3"))
    aux = inception.index("AuxLogits.conv0.conv")
    assert inception[aux - 1] == "Mixed_6e.branch_pool.bn"
    assert inception[aux + 5] == "Mixed_7a.branch3x3_1.conv"
    bert = layer_names(zoo("bert_base"))
    queries = [bert.index(f"bert.encoder.layer.{i}.attention.self.query") for i in range(12)]
    assert queries == sorted(queries)
    assert bert.index("bert.pooler.dense") < bert.index("cls.predictions.transform.dense")


def test_tied_decoder_weight_is_counted_once_in_the_embedding_layer():
    profile = zoo("bert_base")
    layers = {layer.name: layer for layer in profile.layers}
    assert [t.name for t in layers["bert.embeddings.word_embeddings"].tensors] == [
        "bert.embeddings.word_embeddings.weight"
    ]
    assert [(t.name, t.numel) for t in layers["cls.predictions.decoder"].tensors] == [
        ("cls.predictions.decoder.bias", 30522)
    ]
    assert sum(t.numel == 30522 * 768 for t in profile.tensors()) == 1


class RegisteredBackwards(nn.Module):
    """Modules registered in reverse of their execution, a tied weight and products between layers."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 5)
        self.stem = nn.Linear(4, 3, bias=False)
        self.echo = nn.Linear(4, 3)
        self.echo.weight = self.stem.weight

    def forward(self, x):  # x: 2 x 4
        h = self.stem(x)  # 2·2·4·3 = 48 FLOPs
        gram = h.T @ h  # 2·3·2·3 = 36, outside any layer: charged to echo, the next to run
        mixed = (h + self.echo(x)) @ gram  # echo 48; the product 2·2·3·3 = 36 goes to head
        y = self.head(mixed)  # 2·2·3·5 = 60
        return y @ y.T  # 2·2·5·2 = 40 after the last layer: charged to head


def test_forward_layers_follow_execution_and_charge_flops_forward():
    with torch.device("meta"):
        model = RegisteredBackwards()
        layers = forward_layers(model, torch.empty(2, 4))
    assert [(l.name, [t.name for t in l.tensors], l.flops) for l in layers] == [
        ("stem", ["stem.weight"], 48),
        ("echo", ["echo.bias"], 36 + 48),
        ("head", ["head.weight", "head.bias"], 36 + 60 + 40),
    ]
    assert sum(l.flops for l in layers) == 48 + 36 + 48 + 36 + 60 + 40


def test_layer_times_are_flops_over_throughput():
    resnet = zoo("resnet50", batch_size=1, device=TERAFLOP)
    conv1_flops = 2 * (112 * 112 * 64) * (7 * 7 * 3)  # 2 x outputs x MACs per output
    assert resnet.layers[0].forward_time == pytest.approx(conv1_flops / TERAFLOP, rel=1e-12)
    assert resnet.layers[0].backward_time == pytest.approx(2 * conv1_flops / TERAFLOP, rel=1e-12)
    assert resnet.layers[-1].forward_time == pytest.approx(2 * 2048 * 1000 / TERAFLOP, rel=1e-12)
    assert resnet.layers[1].forward_time == 0.0  # batch norm: no FLOPs counted

    bert = {layer.name: layer for layer in zoo("bert_base", batch_size=1, device=TERAFLOP).layers}
    seq, hidden, heads = 64, 768, 12
    projection = 2 * seq * hidden * hidden
    attention_products = 2 * (2 * heads * seq * seq * (hidden // heads))  # scores and context
    output_dense = bert["bert.encoder.layer.0.attention.output.dense"]
    assert output_dense.forward_time == pytest.approx((projection + attention_products) / TERAFLOP, rel=1e-12)
    decoder = bert["cls.predictions.decoder"]
    assert decoder.forward_time == pytest.approx(2 * seq * hidden * 30522 / TERAFLOP, rel=1e-12)


def test_metadata_names_model_batch_device_and_flops():
    profile = zoo("resnet152", device=TERAFLOP)
    assert profile.metadata["model"] == "resnet152"
    assert profile.metadata["batch_size"] == 32  # acp-sgd §V-A and asc-wfbp Table III
    assert profile.metadata["device"] == "1e+12 FLOP/s"
    assert profile.metadata["forward_flops"] == pytest.approx(profile.forward_time * TERAFLOP, rel=1e-9)
    assert profile.metadata["backward_flops"] == 2 * profile.metadata["forward_flops"]
    assert zoo("bert_large").metadata["batch_size"] == 8  # acp-sgd §V-A
    assert zoo("googlenet").metadata["batch_size"] == 64  # mg-wfbp §V


@pytest.mark.parametrize("name, small, large", [("resnet50", 4, 12), ("bert_base", 2, 6)])
def test_times_are_positive_and_linear_in_batch_size_above_the_launch_overhead(name, small, large):
    overhead = DEVICES["V100"].launch_overhead
    smaller, larger = zoo(name, small, "V100"), zoo(name, large, "V100")
    for a, b in zip(smaller.layers, larger.layers):
        assert a.forward_time > 0 and a.backward_time > 0
        assert b.forward_time - overhead == pytest.approx(3 * (a.forward_time - overhead), rel=1e-9, abs=1e-15)
        assert a.backward_time - overhead == pytest.approx(2 * (a.forward_time - overhead), rel=1e-9, abs=1e-15)


def test_faster_device_gives_smaller_times():
    slow, fast = zoo("googlenet", device="K80"), zoo("googlenet", device="RTX3090")
    assert all(f.forward_time < s.forward_time for f, s in zip(fast.layers, slow.layers))
    assert all(f.backward_time < s.backward_time for f, s in zip(fast.layers, slow.layers))


def test_device_names_are_case_insensitive():
    assert zoo("vgg16", device="v100") == zoo("vgg16", device="V100")


def test_json_round_trip_keeps_the_profile():
    profile = zoo("mobilenet_v2", device="RTX2080Ti")
    restored = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert restored == profile
    assert restored.metadata == profile.metadata


def test_unknown_model_lists_the_valid_names():
    with pytest.raises(ConfigError, match="unknown model 'resnet51'.*resnet50"):
        zoo("resnet51")


def test_unknown_device_lists_the_presets():
    with pytest.raises(ConfigError, match="unknown device 'A100'.*K80.*V100"):
        zoo("vgg16", device="A100")


@pytest.mark.parametrize("device", [0, -1.0, math.nan, math.inf, True, None])
def test_bad_custom_throughput_is_rejected(device):
    with pytest.raises(ConfigError, match="'device'"):
        zoo("vgg16", device=device)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True, "8"])
def test_batch_size_must_be_a_positive_integer(batch_size):
    with pytest.raises(ConfigError, match="'batch_size'"):
        zoo("vgg16", batch_size=batch_size)
