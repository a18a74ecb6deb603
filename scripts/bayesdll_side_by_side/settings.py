"""The comparison's settings: methods, BayesDLL's files, its Table 2, and the full and fast runs."""

from __future__ import annotations

from bayeswrap.app.config import BAYESDLL_PER_METHOD

STEM = "bayesdll_table2_mnist5k"
METHODS = ("vi", "mc_dropout", "sgld", "laplace")
#: BayesDLL's file name per method (``methods/<name>.py``)
THEIR_FILES = {"vi": "vi", "mc_dropout": "mc_dropout", "sgld": "sgld", "laplace": "la"}
NST = (0, 5)
#: BayesDLL's Table 2 on MNIST: test error and all-class ECE, both in percent, at nst 0 and nst 5. Its ECE is
#: read as percent like its error: calibration.analyze returns a fraction, and an all-class ECE of 0.12 as a
#: fraction is impossible at 2 % error (every one of the N·K items would have to be off by 12 points on average).
REFERENCE = {
    "vi": {"error": (2.25, 2.75), "ece": (0.12, 0.11)},
    "mc_dropout": {"error": (2.47, 2.43), "ece": (0.32, 0.18)},
    "sgld": {"error": (2.74, 2.75), "ece": (0.23, 0.21)},
    "laplace": {"error": (2.41, 1.51), "ece": (0.24, 0.12)},
}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # BayesDLL's datasets.prepare("mnist")
ECE_BINS = 15  # BayesDLL's --ece_num_bins default

FULL = {"epochs": 15, "batch_size": 128, "lr": 1e-2, "momentum": 0.5, "width": 1000, "depth": 3,
        "test_fraction": 0.2, "train_limit": None, "test_limit": None, "seeds": (0, 1, 2),
        "sgld_burn_in_epochs": BAYESDLL_PER_METHOD["sgld"]["burn_in_epochs"],
        "sgld_thinning": BAYESDLL_PER_METHOD["sgld"]["thinning"], "vi_init_std": 1e-6}
FAST = {**FULL, "epochs": 2, "batch_size": 64, "width": 32, "train_limit": 256, "test_limit": 200, "seeds": (0,),
        "sgld_burn_in_epochs": 1, "sgld_thinning": 2}
