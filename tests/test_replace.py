"""flashopm swapped into existing models: modules found by layout, checked on a random problem,
replaced in place with their parameters kept (the same tensors), and refused where the math differs.

The stand-ins below are laid out as OpenFold's, Protenix's, Boltz's and the specification's modules
(their own LayerNorm and Linear classes, batch dims, transposes, the float32 sum of older Boltz
releases), written from each model's math, independently of flashopm.reference."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashopm
from conftest import requires_cuda
from flashopm.testing import rel_error


class OwnLayerNorm(nn.Module):
    """A LayerNorm that is not nn.LayerNorm, as OpenFold's primitives define one."""

    def __init__(self, c_in, eps=1e-5):
        super().__init__()
        self.c_in, self.eps = (c_in,), eps
        self.weight = nn.Parameter(torch.ones(c_in))
        self.bias = nn.Parameter(torch.zeros(c_in))

    def forward(self, x):
        return F.layer_norm(x, self.c_in, self.weight, self.bias, self.eps)


class OwnLinear(nn.Linear):
    def __init__(self, c_in, c_out, bias=True, init="default"):
        super().__init__(c_in, c_out, bias=bias)
        if init == "final":
            with torch.no_grad():
                self.weight.zero_()
                if self.bias is not None:
                    self.bias.zero_()


class OpenFoldLike(nn.Module):
    """out = linear_out(sum_s a_si (x) b_sj) / (eps + sum_s m_si m_sj), m (*, S, N, C)."""

    def __init__(self, c_m, c_z, c_hidden, eps=1e-3, bias=True, divide_bias=True):
        super().__init__()
        self.c_z, self.c_hidden, self.eps, self.chunk_size = c_z, c_hidden, eps, 4
        self.divide_bias = divide_bias
        self.layer_norm = OwnLayerNorm(c_m)
        self.linear_1 = OwnLinear(c_m, c_hidden, bias=bias)
        self.linear_2 = OwnLinear(c_m, c_hidden, bias=bias)
        self.linear_out = OwnLinear(c_hidden ** 2, c_z, init="final")

    def forward(self, m, mask=None, chunk_size=None, inplace_safe=False):
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        m = self.layer_norm(m)
        mask = mask.unsqueeze(-1)
        a = (self.linear_1(m) * mask).transpose(-2, -3)  # [*, N, S, H]
        b = (self.linear_2(m) * mask).transpose(-2, -3)
        outer = torch.einsum("...bac,...dae->...bdce", a, b)
        outer = outer.reshape(*outer.shape[:-2], -1)
        norm = torch.einsum("...abc,...adc->...bdc", mask, mask)
        if self.divide_bias:
            return self.linear_out(outer) / (self.eps + norm)
        return F.linear(outer, self.linear_out.weight) / (self.eps + norm) + self.linear_out.bias


class BoltzLike(nn.Module):
    """out = proj_o(sum_s a_si (x) b_sj / max(sum_s m_si m_sj, 1)), the sum in float32 at least."""

    def __init__(self, c_in, c_hidden, c_out):
        super().__init__()
        self.c_hidden = c_hidden
        self.norm = nn.LayerNorm(c_in)
        self.proj_a = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_b = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_o = nn.Linear(c_hidden * c_hidden, c_out)

    def forward(self, m, mask, chunk_size=None):
        mask = mask.unsqueeze(-1).to(m)
        m = self.norm(m)
        a, b = self.proj_a(m) * mask, self.proj_b(m) * mask
        pair = (mask[:, :, None, :] * mask[:, :, :, None]).sum(1).clamp(min=1)
        z = torch.einsum("bsic,bsjd->bijcd", a.float(), b.float())
        return self.proj_o((z.reshape(*z.shape[:3], -1) / pair).to(m))


class MeanOverAllSequences(nn.Module):
    """The specification's layout, but the mean is over all S whatever the mask: not the op."""

    def __init__(self, c, d, h):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.proj_a, self.proj_b = nn.Linear(c, h), nn.Linear(c, h)
        self.out_proj = nn.Linear(h * h, d)

    def forward(self, x, mask):
        x = self.layer_norm(x)
        a, b = self.proj_a(x) * mask[..., None], self.proj_b(x) * mask[..., None]
        outer = torch.einsum("bsih,bsjk->bijhk", a, b) / x.shape[1]
        return self.out_proj(outer.flatten(-2))


class Block(nn.Module):
    def __init__(self, opm):
        super().__init__()
        self.outer_product_mean = opm
        self.transition = nn.Linear(8, 8)


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return module


def _problem(C, batch=(2,), S=4, N=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(*batch, S, N, C, generator=g)
    mask = torch.randint(0, 3, (*batch, S, N), generator=g).float() / 2
    mask[..., 2] = 0.0  # a residue masked in every sequence
    return m, mask


def _trunk():
    shared = OpenFoldLike(16, 8, 4)
    return nn.ModuleDict({
        "evoformer": nn.ModuleList([Block(shared), Block(OpenFoldLike(16, 8, 4, bias=False)), Block(shared)]),
        "boltz": nn.Sequential(Block(BoltzLike(12, 4, 6))),
        "spec": flashopm.Model(10, 5, 3),
        "of_reference": flashopm.OpenFoldOuterProductMeanReference(16, 8, 4, eps=1e-2),
    })


def test_each_convention_is_replaced_in_place_with_its_parameters():
    torch.manual_seed(0)
    trunk = _randomise(_trunk())
    before = copy.deepcopy(trunk)
    params = dict(trunk.named_parameters(remove_duplicate=False))
    state = {k: v.clone() for k, v in trunk.state_dict().items()}

    names = flashopm.replace_outer_product_means(trunk)

    assert names == ["evoformer.0.outer_product_mean", "evoformer.1.outer_product_mean",
                     "evoformer.2.outer_product_mean", "boltz.0.outer_product_mean", "spec", "of_reference"]
    ev = trunk["evoformer"]
    assert isinstance(ev[0].outer_product_mean, flashopm.OpenFoldOuterProductMean)
    assert ev[2].outer_product_mean is ev[0].outer_product_mean  # still one module, shared
    assert isinstance(trunk["boltz"][0].outer_product_mean, flashopm.BoltzOuterProductMean)
    assert isinstance(trunk["spec"], flashopm.ModelNew)
    assert trunk["of_reference"].eps == 1e-2
    for name, p in trunk.named_parameters(remove_duplicate=False):
        assert p is params[name], name  # the same tensors: optimizers and wrappers stay valid
    after = trunk.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], state[k]) for k in state)

    for key, mod, C, batch in [("evoformer.0.outer_product_mean", ev[0].outer_product_mean, 16, (2, 3)),
                               ("evoformer.1.outer_product_mean", ev[1].outer_product_mean, 16, ()),
                               ("boltz.0.outer_product_mean", trunk["boltz"][0].outer_product_mean, 12, (2,)),
                               ("spec", trunk["spec"], 10, (2,)),
                               ("of_reference", trunk["of_reference"], 16, (1,))]:
        m, mask = _problem(C, batch if batch else (1,))
        if batch == ():
            m, mask = m[0], mask[0]  # OpenFold's module takes any number of batch dims, none included
        want = before.get_submodule(key)(m, mask)
        got = mod(m, mask)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    assert flashopm.replace_outer_product_means(trunk) == []  # nothing left to replace


def test_an_optimizer_built_before_the_swap_trains_the_replaced_module():
    torch.manual_seed(1)
    model = _randomise(Block(OpenFoldLike(16, 8, 4)))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flashopm.replace_outer_product_means(model)
    m, mask = _problem(16)
    for mod in (model, twin):
        mod.outer_product_mean(m, mask).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if name.startswith("outer_product_mean."):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    w = model.outer_product_mean.linear_1.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.outer_product_mean.linear_1.weight, w)


def test_the_training_flag_dtype_and_device_stay_the_modules():
    model = Block(BoltzLike(12, 4, 6)).double().eval()
    flashopm.replace_outer_product_means(model)
    new = model.outer_product_mean
    assert isinstance(new, flashopm.BoltzOuterProductMean) and not new.training
    assert all(p.dtype == torch.float64 for p in new.parameters())


@pytest.mark.parametrize("decoy", ["bias_not_divided", "mean_over_all_sequences"])
def test_a_module_with_the_layout_but_other_math_is_left_in_place(decoy):
    torch.manual_seed(2)
    opm = OpenFoldLike(16, 8, 4, divide_bias=False) if decoy == "bias_not_divided" else MeanOverAllSequences(10, 5, 3)
    model = Block(opm)
    with pytest.warns(UserWarning, match="left in place.*does not agree.*differs from the"):
        assert flashopm.replace_outer_product_means(model) == []
    assert model.outer_product_mean is opm
    with pytest.raises(ValueError, match="layout but its output does not agree"):
        flashopm.convert_outer_product_mean(opm)
    # Without the check the layout alone decides (the caller vouches for the math).
    assert flashopm.replace_outer_product_means(model, verify=False) == ["outer_product_mean"]


def test_modules_of_no_known_layout_are_untouched_and_named_in_the_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flashopm.replace_outer_product_means(model) == []
    with pytest.raises(ValueError, match=r"openfold layout \('layer_norm'.*no submodules `layer_norm`.*boltz layout"):
        flashopm.convert_outer_product_mean(nn.Linear(4, 4))
    wide = BoltzLike(12, 4, 6)
    wide.proj_o = nn.Linear(15, 6)  # not hidden_dim squared
    with pytest.raises(ValueError, match="not a linear layer from 16"):
        flashopm.convert_outer_product_mean(wide)
    biased = BoltzLike(12, 4, 6)
    biased.proj_a, biased.proj_b = nn.Linear(12, 4), nn.Linear(12, 4)
    with pytest.raises(ValueError, match=r"boltz layout \(.*\): the projections have biases"):
        flashopm.convert_outer_product_mean(biased)


def test_convert_returns_a_module_sharing_the_submodules():
    opm = _randomise(OpenFoldLike(16, 8, 4, eps=1e-4))
    new = flashopm.convert_outer_product_mean(opm)
    assert isinstance(new, flashopm.OpenFoldOuterProductMean) and new.eps == 1e-4
    assert new.layer_norm is opm.layer_norm and new.linear_out is opm.linear_out
    assert flashopm.convert_outer_product_mean(new) is new
    m, mask = _problem(16)
    assert rel_error(new(m, mask), opm(m, mask)) < 1e-6


class PortWithOwnNames(nn.Module):
    """A port with names of its own and a fixed epsilon: (z / (norm + 1e-3)), bias divided."""

    def __init__(self, c_m, c, c_z, bias=False):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_a = nn.Linear(c_m, c, bias=bias)
        self.linear_b = nn.Linear(c_m, c, bias=bias)
        self.linear_out = nn.Linear(c * c, c_z)

    def forward(self, msa_feat, msa_mask):
        m = self.layer_norm(msa_feat)
        m_a, m_b = self.linear_a(m) * msa_mask[..., None], self.linear_b(m) * msa_mask[..., None]
        z = self.linear_out(torch.einsum("...sic,...sjd->...ijcd", m_a, m_b).flatten(start_dim=-2))
        norm = torch.einsum("...si,...sj->...ij", msa_mask, msa_mask)
        return z / (norm[..., None] + 1e-3)


PORT_LAYOUT = flashopm.OuterProductMeanLayout(("layer_norm", "linear_a", "linear_b", "linear_out"), "openfold",
                                              eps=1e-3)


def test_a_layout_given_by_the_caller_keeps_the_ports_names():
    torch.manual_seed(5)
    port = _randomise(PortWithOwnNames(16, 4, 8))
    model = nn.ModuleList([Block(port), Block(_randomise(BoltzLike(12, 4, 6)))])
    keys = list(model.state_dict())
    assert flashopm.replace_outer_product_means(model) == ["1.outer_product_mean"]  # the port's names are unknown
    names = flashopm.replace_outer_product_means(model, layouts=[PORT_LAYOUT])
    assert names == ["0.outer_product_mean"]
    new = model[0].outer_product_mean
    assert isinstance(new, flashopm.NamedOuterProductMean)
    assert new.normalization == "openfold" and new.norm_eps == 1e-3 and new.linear_a is port.linear_a
    assert list(model.state_dict()) == keys  # a checkpoint of the port still loads
    m, mask = _problem(16, batch=(2, 3))
    torch.testing.assert_close(new(m, mask, 4), port(m, mask), rtol=1e-5, atol=1e-5)  # extra arguments ignored


def test_the_first_layout_that_agrees_is_taken():
    port = PortWithOwnNames(16, 4, 8)
    wrong_eps = flashopm.OuterProductMeanLayout(PORT_LAYOUT.names, "openfold", eps=1e-2)
    wrong_norm = flashopm.OuterProductMeanLayout(PORT_LAYOUT.names, "boltz")
    new = flashopm.convert_outer_product_mean(port, layouts=[wrong_eps, wrong_norm, PORT_LAYOUT])
    assert new.norm_eps == 1e-3
    with pytest.raises(ValueError, match=r"openfold layout .*differs.*; as boltz layout .*differs"):
        flashopm.convert_outer_product_mean(port, layouts=[wrong_eps, wrong_norm])
    # without the check the first layout the module has is taken, right or wrong
    assert flashopm.convert_outer_product_mean(port, layouts=[wrong_eps], verify=False).norm_eps == 1e-2


def test_layouts_are_checked_when_made():
    with pytest.raises(ValueError, match="4 attribute names"):
        flashopm.OuterProductMeanLayout(("a", "b", "c"))
    with pytest.raises(ValueError, match="normalization must be one of"):
        flashopm.OuterProductMeanLayout(("a", "b", "c", "d"), "mean")
    with pytest.raises(TypeError, match="OuterProductMeanLayout objects"):
        flashopm.replace_outer_product_means(nn.Linear(2, 2), layouts=[("a", "b", "c", "d")])
    parts = {"norm": nn.LayerNorm(4), "a": nn.Linear(4, 2), "b": nn.Linear(4, 2)}
    with pytest.raises(ValueError, match="takes 4 submodules"):
        flashopm.NamedOuterProductMean(parts)
    with pytest.raises(ValueError, match="normalization must be one of"):
        flashopm.NamedOuterProductMean({**parts, "o": nn.Linear(4, 3)}, normalization="mean")


@requires_cuda
def test_replaced_modules_match_the_originals_on_cuda():
    torch.manual_seed(4)
    trunk = _trunk()
    trunk["port"] = PortWithOwnNames(16, 8, 12, bias=True)
    trunk = _randomise(trunk).cuda()
    before = copy.deepcopy(trunk)
    names = flashopm.replace_outer_product_means(trunk, layouts=[PORT_LAYOUT])
    assert len(names) == 7
    for key, C in [("evoformer.0.outer_product_mean", 16), ("evoformer.1.outer_product_mean", 16),
                   ("boltz.0.outer_product_mean", 12), ("spec", 10), ("of_reference", 16), ("port", 16)]:
        m, mask = (t.cuda() for t in _problem(C, S=9, N=33))
        want = before.get_submodule(key)(m, mask)
        got = trunk.get_submodule(key)(m, mask)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=key)
