"""The MCMC sampler protocol: kernels stepped by the one runner, without a wrapped model."""

import math

import pytest
import torch

from bayeswrap.core.samples import SampleStore
from bayeswrap.methods.mcmc import (
    ChainState,
    FlatLayout,
    HMCKernel,
    MCMCKernel,
    Potential,
    RandomWalkKernel,
    kept_draws,
)
from bayeswrap.methods.mcmc.runner import sample_chains


def _gaussian(scales):
    """U of N(0, diag(scales²)) over a flat vector."""
    scales = torch.as_tensor(scales, dtype=torch.float64)
    return lambda v: 0.5 * (v / scales).square().sum()


def _run(kernel, energy, template, *, chains=4, num_warmup=300, num_samples=1000, thinning=1, max_samples=2000):
    layout = FlatLayout(template)
    store = SampleStore({n: t.expand(chains, *t.shape) for n, t in template.items()}, max_samples, device=None)
    start = {n: torch.zeros(chains, *t.shape, dtype=torch.float64) for n, t in template.items()}
    stats = sample_chains(kernel, Potential(energy), layout, start, store, num_warmup=num_warmup,
                          num_samples=num_samples, thinning=thinning, generator=torch.Generator().manual_seed(0),
                          label="test")
    return stats, store


@pytest.mark.parametrize("kernel", [HMCKernel(8, 0.8, 0.1), RandomWalkKernel(0.5)], ids=["hmc", "mh"])
def test_kernels_sample_a_gaussian_through_the_runner(kernel):
    template = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros((), dtype=torch.float64)}
    scales = [1.0, 3.0, 0.2]
    stats, store = _run(kernel, _gaussian(scales), template, num_samples=800 if isinstance(kernel, HMCKernel)
                        else 8000, max_samples=10_000)
    draws = torch.cat([store.all()["a"], store.all()["b"][..., None]], -1).reshape(-1, 3)
    assert torch.allclose(draws.std(0), torch.tensor(scales, dtype=torch.float64), rtol=0.15)
    assert draws.mean(0).abs().max() < 0.2 * max(scales)
    assert len(stats["acceptance_rate"]) == 4 and stats["divergences"] == [0, 0, 0, 0]
    assert ("step_size" if isinstance(kernel, HMCKernel) else "proposal_scale") in stats


class _Independence(MCMCKernel):
    """A kernel written against the protocol alone: independent proposals from N(0, 1), MH-corrected."""

    def setup(self, potential, num_warmup, generator, initial):
        self.potential, self.steps = potential, 0

    def step(self, state, generator):
        proposal = torch.randn(state.position.shape, generator=generator, dtype=state.position.dtype)
        values = self.potential.values(proposal)
        log_ratio = (state.potential - values) + 0.5 * (proposal.square() - state.position.square()).sum(1)
        accept = torch.log(torch.rand(len(values), generator=generator, dtype=values.dtype)) < log_ratio
        self.steps += 1
        return ChainState(torch.where(accept[:, None], proposal, state.position), accept, torch.zeros_like(accept),
                          torch.where(accept, values, state.potential))

    def diagnostics(self):
        return {"steps": self.steps}


def test_a_new_kernel_plugs_into_the_runner_which_owns_warmup_thinning_and_counts():
    template = {"w": torch.zeros(2, dtype=torch.float64)}
    stats, store = _run(_Independence(), _gaussian([1.0, 1.0]), template, chains=3, num_warmup=7, num_samples=40,
                        thinning=3)
    assert stats["steps"] == 47 and stats["num_warmup"] == 7 and stats["thinning"] == 3
    assert len(store) == kept_draws(40, 3, 2000) == 14  # post-warm-up iterations 0, 3, ..., 39
    assert stats["acceptance_rate"] == [1.0, 1.0, 1.0]  # the proposal is the target: every move is accepted
    assert "the method's starting values" in _Independence().start_option()
    with pytest.raises(TypeError, match="abstract"):
        type("NoStep", (MCMCKernel,), {"setup": _Independence.setup, "diagnostics": _Independence.diagnostics})()


def test_the_runner_refuses_a_non_finite_start_and_warns_about_stuck_chains():
    template = {"w": torch.zeros(1, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"initial potential U\(θ\) is not finite for chain\(s\) \[0, 1\]"):
        _run(RandomWalkKernel(0.1), lambda v: v.sum() * math.inf, template, chains=2)
    with pytest.warns(RuntimeWarning, match=r"test: chain\(s\) \[0, 1\] hardly moved .* started from init_scale=1e\+30"):
        _run(RandomWalkKernel(1e30), _gaussian([1.0]), template, chains=2, num_warmup=0, num_samples=20)


def test_potential_falls_back_to_one_chain_after_another_without_a_batching_rule():
    def energy(v):  # data-dependent control flow: no vmap
        return v.square().sum() if bool(v.sum() > -1e30) else v.sum()

    states = torch.randn(3, 4, dtype=torch.float64)
    potential = Potential(energy)
    grads, values = potential.grad_and_values(states)
    assert not potential.vmap_ok
    assert torch.allclose(values, states.square().sum(1)) and torch.allclose(grads, 2 * states)
    assert torch.allclose(Potential(_gaussian([1.0] * 4)).values(states), 0.5 * states.square().sum(1))


def test_flat_layout_round_trips_named_tensors():
    template = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    layout = FlatLayout(template)
    named = {"w": torch.randn(5, 2, 3), "b": torch.randn(5, 3)}
    flat = layout.flatten(named)
    assert flat.shape == (5, layout.size) == (5, 9)
    assert all(torch.equal(layout.split(flat)[n], named[n]) for n in named)
    assert all(torch.equal(layout.unflatten(flat[2])[n], named[n][2]) for n in named)


def test_each_nuts_chain_is_a_pyro_mcmc_run_of_that_chain_alone():
    pytest.importorskip("pyro", reason="pyro-ppl is not installed: the NUTS kernel is skipped")
    from pyro.infer import MCMC, NUTS

    from bayeswrap.methods.mcmc import NUTSKernel

    energy = _gaussian([1.0, 2.0])
    _, store = _run(NUTSKernel(0.8), energy, {"w": torch.zeros(2, dtype=torch.float64)}, chains=2, num_warmup=20,
                    num_samples=15)
    generator = torch.Generator().manual_seed(0)  # the runner's: one seed per chain, drawn at set-up
    for chain in range(2):
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            run = MCMC(NUTS(potential_fn=lambda p: energy(p["theta"]), target_accept_prob=0.8, full_mass=False),
                       num_samples=15, warmup_steps=20, initial_params={"theta": torch.zeros(2, dtype=torch.float64)},
                       disable_progbar=True)
            run.run()
        assert torch.equal(store.all()["w"][:, chain], run.get_samples()["theta"])
