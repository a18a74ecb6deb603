"""Part 2, variable selection: LBBNN-LRT and LBBNN-FLOW on a simulated logistic regression with 20 covariates."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from scripts.lbbnn_experiments.settings import BETA, VARSEL_METHODS


def simulate_logistic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A simulated data set with the structure of the paper's logistic-regression study.

    Covariates (raw scale, chosen to resemble the EMJMCMC ``sim3`` design the paper uses):

    * X1–X3: one-hot of c1 ∈ {0, 1, 2}, P = (0.12, 0.45, 0.43); X4–X6: one-hot of c2, a copy of c1 with
      probability 0.43, else an independent draw (P(c2 = c1) ≈ 0.66);
    * X7 = 5.6·χ²₁, X8 ~ Gamma(0.67, 6.9) (skewed, positive, independent);
    * X11 ~ U(−10, 1); X9 = −2.9 + 0.35·X11 + N(0, 0.69²) (corr ≈ 0.85 with X11);
      X10 = −4.0 + 0.11·X11 − 0.98·(X9's noise) + N(0, 0.65²);
    * X12–X15: Gaussian, stds (0.46, 0.41, 0.32, 0.60), correlations −0.77 (X12, X14), −0.95 (X13, X15) and
      smaller ones;
    * X16 = sin(2πU) (arcsine on [−1, 1]); X17 = i² for a random permutation i of 1..n;
    * X18 = X2·X10 (an interaction); X19 = −0.43·X12 + 0.40·X13 − 0.60·X14 − 0.51·X15 + N(0, 1.74²);
    * X20 ~ U(−10, 1), U(−4, 40) or U(−20, 2) given c1 = 0, 1, 2.

    y ~ Bernoulli(sigmoid(β0 + Xβ)) with :data:`BETA` and β0 = −median(Xβ). Returns the model inputs (binary
    X1–X6 as they are, X7–X20 standardised), the labels and the raw covariates.
    """
    rng = np.random.default_rng(seed)
    probs = np.array([0.12, 0.45, 0.43])
    c1 = rng.choice(3, size=n, p=probs)
    c2 = np.where(rng.random(n) < 0.43, c1, rng.choice(3, size=n, p=probs))
    X = np.zeros((n, 20))
    X[np.arange(n), c1] = 1.0
    X[np.arange(n), 3 + c2] = 1.0
    X[:, 6] = 5.6 * rng.standard_normal(n) ** 2
    X[:, 7] = rng.gamma(0.67, 6.9, n)
    X[:, 10] = rng.uniform(-10.0, 1.0, n)
    noise9 = rng.normal(0.0, 0.69, n)
    X[:, 8] = -2.9 + 0.35 * X[:, 10] + noise9
    X[:, 9] = -4.0 + 0.11 * X[:, 10] - 0.98 * noise9 + rng.normal(0.0, 0.65, n)
    sd = np.array([0.46, 0.41, 0.32, 0.60])
    corr = np.array([[1.0, 0.0, -0.77, 0.18], [0.0, 1.0, -0.28, -0.95],
                     [-0.77, -0.28, 1.0, 0.25], [0.18, -0.95, 0.25, 1.0]])
    X[:, 11:15] = rng.multivariate_normal(np.zeros(4), corr * np.outer(sd, sd), size=n)
    X[:, 15] = np.sin(2.0 * np.pi * rng.random(n))
    X[:, 16] = rng.permutation(np.arange(1, n + 1)).astype(float) ** 2
    X[:, 17] = X[:, 1] * X[:, 9]
    X[:, 18] = X[:, 11:15] @ np.array([-0.43, 0.40, -0.60, -0.51]) + rng.normal(0.0, 1.74, n)
    low = np.array([-10.0, -4.0, -20.0])[c1]
    high = np.array([1.0, 40.0, 2.0])[c1]
    X[:, 19] = rng.uniform(low, high)
    eta = X @ np.asarray(BETA)
    eta = eta - np.median(eta)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-np.clip(eta, -60, 60)))).astype(np.int64)
    Z = X.copy()
    Z[:, 6:] = (Z[:, 6:] - Z[:, 6:].mean(0)) / Z[:, 6:].std(0)
    return torch.as_tensor(Z, dtype=torch.float32), torch.as_tensor(y), X


class TwoClassLogistic(nn.Module):
    """Logistic regression as a 2-class classifier: logits ``[0, w·x + b]`` (one weight per covariate)."""

    def __init__(self, num_features: int = 20):
        super().__init__()
        self.linear = nn.Linear(num_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, 2)``: ``[0, w·x + b]`` for inputs ``(B, num_features)``."""
        z = self.linear(x)
        return torch.cat([torch.zeros_like(z), z], 1)


def tpr_fpr(selected: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """True- and false-positive rates of a boolean selection against the boolean truth."""
    selected, truth = np.asarray(selected, bool), np.asarray(truth, bool)
    tpr = float((selected & truth).sum() / max(truth.sum(), 1))
    fpr = float((selected & ~truth).sum() / max((~truth).sum(), 1))
    return tpr, fpr


def run_variable_selection(cfg: dict, log=print) -> dict:
    """LBBNN-LRT and LBBNN-FLOW on ``cfg["datasets"]`` simulated data sets: α̃, TPR and FPR per data set."""
    truth = np.asarray(BETA) != 0
    per_dataset = []
    for d in range(cfg["datasets"]):
        x, y, _ = simulate_logistic(cfg["n"], seed=100 + d)
        entry = {"dataset": d, "seed": 100 + d, "positive_fraction": float(y.double().mean())}
        for name, flow_length in VARSEL_METHODS.items():
            torch.manual_seed(d)
            model = TwoClassLogistic(x.shape[1])
            with torch.no_grad():
                for p in model.parameters():
                    p.uniform_(-0.01, 0.01)
            bnn = bw.wrap(model, "lbbnn", num_data=len(y), prior_std=1.0, prior_mean="zero",
                          prior_inclusion=cfg["prior_inclusion"], flow_length=flow_length,
                          init_inclusion_logit=cfg["init_inclusion_logit"], init_rho=cfg["init_rho"],
                          flow_hidden=cfg["flow_hidden"])
            tic = time.perf_counter()
            history = bw.fit(bnn, ex.shuffled_loader((x, y), cfg["batch_size"], d), epochs=cfg["epochs"],
                             optimizer=ex.make_optimizer(bnn, cfg)[0], progress=False)
            alpha = bnn.inclusion_probs()["linear.weight"].detach().reshape(-1).numpy()
            tpr, fpr = tpr_fpr(alpha > 0.5, truth)
            with torch.no_grad():
                acc = ex.top1_accuracy(bnn.predict(x, num_samples=20, generator=torch.Generator().manual_seed(d)), y)
            entry[name] = {"alpha": [float(a) for a in alpha], "tpr": tpr, "fpr": fpr, "train_accuracy": acc,
                           "final_train_error": history[-1]["train_error"], "seconds": time.perf_counter() - tic}
            log(f"[varsel] data set {d} {name:10s}: TPR {tpr:.3f}, FPR {fpr:.3f}, training accuracy {acc:.3f} "
                f"({entry[name]['seconds']:.0f} s)")
        per_dataset.append(entry)
    summary = {}
    for name in VARSEL_METHODS:
        tprs = [e[name]["tpr"] for e in per_dataset]
        fprs = [e[name]["fpr"] for e in per_dataset]
        freq = np.mean([np.asarray(e[name]["alpha"]) > 0.5 for e in per_dataset], axis=0)
        summary[name] = {"tpr": float(np.mean(tprs)), "fpr": float(np.mean(fprs)),
                         "tpr_std": float(np.std(tprs)), "fpr_std": float(np.std(fprs)),
                         "selection_frequency": [float(f) for f in freq]}
    return {"beta": list(BETA), "true_nonzero": [int(j + 1) for j in np.flatnonzero(truth)],
            "per_dataset": per_dataset, "summary": summary}

