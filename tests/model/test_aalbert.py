"""AALBERT encoder: shapes for every registered attention, sharing, LayerNorm placement, head mask."""

from __future__ import annotations

import pytest
import torch

from speechattn.attention import available
from speechattn.model import ModelConfig, aalbert, aalbert_base, aalbert_tiny, parameter_groups
from speechattn.model.aalbert import AALBERT, preset_config, sinusoidal_positions

F = 8


def small(**kw) -> AALBERT:
    args = dict(feature_dim=F, dim=32, num_layers=3, num_heads=8, ffn_dim=64, dropout=0.0)
    return aalbert(**{**args, **kw}).eval()


def batch(lengths=(31, 17, 2)):
    torch.manual_seed(0)
    lengths = torch.tensor(lengths)
    x = torch.randn(len(lengths), int(lengths.max()), F)
    x = x * (torch.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
    return x, lengths


@pytest.mark.parametrize("name", available())
def test_every_registered_attention_builds_and_runs(name):
    model = small(attention=name)
    model.train()
    x, lengths = batch()
    hidden = model(x, lengths)
    T = -(-x.shape[1] // 3)
    assert len(hidden) == model.num_layers + 1
    for h in hidden:
        assert h.shape == (3, T, 32)
        assert torch.isfinite(h).all()
    out_len = model.output_lengths(lengths)
    assert out_len.tolist() == [11, 6, 1]
    for b, n in enumerate(out_len.tolist()):
        assert (hidden[-1][b, n:] == 0).all(), "padded positions must be zero"
    recon = model.head(hidden[-1])
    assert recon.shape == (3, T, 3 * F)
    recon.abs().mean().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("conv_kernel", [0, 5])
def test_padded_batch_equals_each_utterance_alone(conv_kernel):
    model = small(conv_position_kernel=conv_kernel, conv_position_groups=4)
    x, lengths = batch()
    hidden = model(x, lengths)[-1]
    for b, n in enumerate(lengths.tolist()):
        alone = model(x[b : b + 1, :n], lengths[b : b + 1])[-1]
        m = alone.shape[1]
        torch.testing.assert_close(hidden[b, :m], alone[0], atol=1e-5, rtol=1e-5)


def test_shared_model_has_one_layer_and_unshared_has_L():
    shared, unshared = small(shared=True), small(shared=False)
    layer = sum(p.numel() for p in shared.encoder.layers[0].parameters())
    assert len(shared.encoder.layers) == 1 and len(unshared.encoder.layers) == 3
    assert unshared.get_num_params() - shared.get_num_params() == 2 * layer
    assert shared.encoder.depth_to_layer == [0, 0, 0]


def test_presets():
    base = aalbert_base(feature_dim=80)
    c = base.config
    assert (c.dim, c.num_layers, c.num_heads, c.ffn_dim, c.shared) == (768, 6, 12, 3072, True)
    assert c.input_dim == 240
    assert base.head.out.out_features == 240
    tiny = aalbert_tiny()
    assert tiny.get_num_params() < base.get_num_params() / 5


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown model preset 'aalbert_huge'.*aalbert_tiny"):
        preset_config("aalbert_huge")


def test_post_ln_outputs_are_normalised_and_pre_ln_residual_stream_is_not():
    x, lengths = batch((30,))
    post = small(pre_norm=False)(x, lengths)
    pre_model = small(pre_norm=True)
    with torch.no_grad():  # a residual stream with a visible offset
        pre_model.encoder.layers[0].ffn.fc2.bias.fill_(3.0)
    pre = pre_model(x, lengths)
    for h in post[1:]:
        torch.testing.assert_close(h.mean(-1), torch.zeros_like(h.mean(-1)), atol=1e-4, rtol=0)
    assert pre[1].mean(-1).abs().min() > 1.0  # residual stream, no LayerNorm applied
    last = pre[-1].mean(-1)  # final LayerNorm of the pre-LN encoder
    torch.testing.assert_close(last, torch.zeros_like(last), atol=1e-4, rtol=0)


def test_head_mask_rows_are_per_depth_even_with_shared_weights():
    model = small()
    x, lengths = batch()
    L, h = model.num_layers, model.num_heads
    ref = model(x, lengths)
    ones = model(x, lengths, head_mask=torch.ones(L, h))
    for a, b in zip(ref, ones):
        torch.testing.assert_close(a, b)
    mask = torch.ones(L, h)
    mask[1] = 0.0  # silence every head at depth 2 only
    masked = model(x, lengths, head_mask=mask)
    torch.testing.assert_close(masked[1], ref[1])  # depth 1 untouched
    assert not torch.allclose(masked[2], ref[2])
    # xi = 0 for every head: the attention output is only W^O's bias, so post-LN gives
    # LN2(a + ffn(a)) with a = LN1(x + b_O)
    layer = model.encoder.layers[0]
    x1 = ref[1]
    pad = torch.arange(x1.shape[1])[None, :] >= model.output_lengths(lengths)[:, None]
    a = layer.attn_norm(x1 + layer.attention.out_proj.bias)
    expected = layer.ffn_norm(a + layer.ffn(a)) * (~pad)[..., None]
    torch.testing.assert_close(masked[2], expected, atol=1e-5, rtol=1e-5)


def test_head_mask_is_differentiable_and_shape_checked():
    model = small()
    x, lengths = batch()
    xi = torch.ones(model.num_layers, model.num_heads, requires_grad=True)
    model(x, lengths, head_mask=xi)[-1].pow(2).sum().backward()
    assert xi.grad is not None and xi.grad.shape == (3, 8) and xi.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="head_mask"):
        model(x, lengths, head_mask=torch.ones(2, 8))


def test_attention_weights_of_a_layer():
    model = small()
    x, lengths = batch()
    w = model.attention_weights(x, lengths, layer=2)
    assert w.shape == (3, 8, 11, 11)
    valid = model.output_lengths(lengths)
    for b, n in enumerate(valid.tolist()):
        torch.testing.assert_close(w[b, :, :n, :n].sum(-1), torch.ones(8, n), atol=1e-5, rtol=0)
        assert (w[b, :, :, n:] == 0).all()
    with pytest.raises(ValueError, match="layer"):
        model.attention_weights(x, lengths, layer=4)


def test_config_errors_are_clear():
    with pytest.raises(
        ValueError, match="model.net.num_heads=4: must be a divisor of model.net.dim=30"
    ):
        ModelConfig(dim=30, num_heads=4)
    with pytest.raises((KeyError, ValueError), match="valid names"):
        small(attention="nope")
    with pytest.raises(ValueError, match="F=8"):
        small()(torch.randn(1, 9, 80), torch.tensor([9]))


def test_sinusoidal_positions_odd_dim():
    p = sinusoidal_positions(5, 7)
    assert p.shape == (5, 7)
    assert torch.allclose(p[0, 0::2], torch.zeros(4)) and torch.allclose(p[0, 1::2], torch.ones(3))


@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0])
def test_position_scale_weights_the_sinusoids(scale):
    model = small(position_scale=scale)
    x = torch.randn(2, 10, model.config.input_dim)
    content = model.embedding.proj(x)
    expected = model.embedding.norm(content + scale * sinusoidal_positions(10, 32))
    assert torch.allclose(model.embedding(x), expected, atol=1e-6)
    # without positions the same frame embeds the same wherever it is
    same = x[:, :1].expand(-1, 10, -1)
    spread = model.embedding(same).std(dim=1).max().item()
    assert (spread < 1e-6) == (scale == 0.0)


def test_conv_positions_add_a_centred_grouped_convolution():
    model = small(conv_position_kernel=5, conv_position_groups=4, position_scale=0.0)
    conv = model.embedding.conv_positions.conv
    x = torch.randn(1, 9, model.config.input_dim)
    h = model.embedding.proj(x)[0]  # (T', D)
    # reference: frame t, channel c of group g reads channels of g at frames t-2 .. t+2
    D, per_group = 32, 32 // 4
    ref = torch.zeros(9, D)
    for t in range(9):
        for c in range(D):
            g = c // per_group
            total = conv.bias[c].clone()
            for j in range(5):
                s = t + j - 2
                if 0 <= s < 9:
                    total += conv.weight[c, :, j] @ h[s, g * per_group : (g + 1) * per_group]
            ref[t, c] = total
    expected = model.embedding.norm(h + torch.nn.functional.gelu(ref))
    torch.testing.assert_close(model.embedding(x)[0], expected, atol=1e-5, rtol=1e-5)
    # it gives order: with no sinusoids, a frame's embedding now depends on its neighbours
    same = x[:, :1].expand(-1, 15, -1).clone()
    same[:, 7] = x[:, 5]
    e = model.embedding(same)[0]  # frames 2 and 12 see five copies of the same frame, 5 does not
    assert torch.allclose(e[2], e[12], atol=1e-5) and not torch.allclose(e[2], e[5], atol=1e-3)


def test_conv_position_errors_are_clear():
    with pytest.raises(
        ValueError, match="conv_position_kernel=4: must be 0 .none. or an odd width"
    ):
        small(conv_position_kernel=4)
    with pytest.raises(ValueError, match="conv_position_groups=5"):
        small(conv_position_kernel=3, conv_position_groups=5)


@pytest.mark.parametrize(
    ("attention", "exempt"),
    [("relpos", {"pos_bias_u", "pos_bias_v"}), ("syn_dense_mh", {"b2"}), ("full", set())],
)
def test_optimizer_groups_decay_matrices_but_not_per_head_biases(attention, exempt):
    model = small(
        attention=attention, attention_options={"max_len": 64} if "syn" in attention else {}
    )
    decayed, undecayed = parameter_groups(model, 0.01)
    assert decayed["weight_decay"] == 0.01 and undecayed["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed_names = {names[id(p)] for p in undecayed["params"]}
    for n, p in model.named_parameters():
        leaf = n.rsplit(".", 1)[-1]
        want_decay = p.dim() >= 2 and leaf not in exempt
        assert (n in undecayed_names) != want_decay, n
    assert len(decayed["params"]) + len(undecayed["params"]) == len(list(model.parameters()))
