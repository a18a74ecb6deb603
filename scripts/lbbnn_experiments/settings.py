"""The experiments' settings: Table 1's rows, the LBBNN options, the paper's numbers, the full and fast runs."""

from __future__ import annotations

import inspect
from collections import OrderedDict

from bayeswrap.methods.lbbnn import LBBNN

STEM = "lbbnn_mnist5k"
FIGURE = "lbbnn_entropy_clusters.png"
BUDGET_FIGURE = f"{STEM}.png"

#: Table 1's rows: name -> (bw method, method options)
TABLE_METHODS: "OrderedDict[str, tuple[str, dict]]" = OrderedDict([
    ("LBBNN", ("lbbnn", {"local_reparam": False})),
    ("LBBNN-LRT", ("lbbnn", {"flow_length": 0})),
    ("LBBNN-FLOW", ("lbbnn", {"flow_length": 2})),
    ("BNN", ("vi", {})),
])
#: the LBBNN options of Table 1 and part 3: the library's defaults (read from the signature, so the report always
#: describes what ``bw.wrap(model, "lbbnn")`` does)
LBBNN_COMMON = {k: v.default for k, v in inspect.signature(LBBNN.__init__).parameters.items()
                if k in ("prior_inclusion", "init_inclusion_logit", "init_rho", "temperature", "flow_hidden", "flow_lr")}
#: the variable-selection models: name -> flow length
VARSEL_METHODS = OrderedDict([("LBBNN-LRT", 0), ("LBBNN-FLOW", 2)])
CLUSTER_METHODS = ("LBBNN-LRT", "MC-dropout", "MAP")

#: The paper's numbers (full MNIST, 60k training images, 250 epochs, 10 runs; Table 1 and §4.1; times on an
#: NVIDIA A10).
PAPER = {
    "table1": {
        "LBBNN": {"mpm_median": 98.10, "full_median": 98.14, "density": 0.098, "seconds_per_epoch": 13.0},
        "LBBNN-LRT": {"mpm_median": 97.95, "full_median": 98.08, "density": 0.103, "seconds_per_epoch": 4.0},
        "LBBNN-FLOW": {"mpm_median": 98.36, "full_median": 98.42, "density": 0.074, "seconds_per_epoch": 17.0},
        "BNN": {"mpm_median": None, "full_median": 98.48, "density": 1.0, "seconds_per_epoch": None},
    },
    "variable_selection": {"LBBNN-LRT": {"tpr": 0.838, "fpr": 0.084}, "LBBNN-FLOW": {"tpr": 0.972, "fpr": 0.074}},
    "epochs": 250,
}

#: The paper's logistic-regression coefficients (X1..X20) of its simulation study.
BETA = (-4.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.2, 0.0, 37.1, 0.0, 0.0, 50.0, -0.00005, 10.0, 3.0, 0.0)

FULL = {
    "seeds": (0, 1, 2),
    "epochs": 30,                       # the paper's 250, scaled by 1/8.3 to fit ~20 minutes on 2 CPU cores
    "lr": 0.01,                         # Adam, constant: LBBNN.recommended["lr"]
    "batch_size": 100,
    "val_fraction": 0.1,
    "train_subset": None,
    "test_subset": None,
    "vi_grid": ((1e-3, False), (3e-3, False), (1e-2, False), (1e-3, True), (3e-3, True), (1e-2, True)),
    "num_samples": 100,                 # S for the test predictions (the paper's TEST_SAMPLES = 100)
    "val_num_samples": 20,              # S for the VI choice on validation
    "curve_every": 3,                   # epochs between two points of the density / accuracy curve over the budget
    "curve_num_samples": 10,            # S for the curve's validation accuracies
    "predict_batch_size": 500,
    "varsel": {"datasets": 5, "n": 2000, "epochs": 250, "batch_size": 400, "lr": 0.01, "prior_inclusion": 0.25,
               "init_inclusion_logit": (1.5, 2.5), "init_rho": -4.5, "flow_hidden": (50, 50),
               "paper_epochs": 500},
    "clusters": {"per_cluster": 100, "epochs": 150, "batch_size": 50, "lr": 1e-2, "num_samples": 100,
                 "grid": 150, "half_width": 7.0, "p_drop": 0.1},
    "digits": {"seeds": (0, 1, 2), "hidden": 200, "epochs": 40, "batch_size": 64, "lr": 1e-2, "num_samples": 30},
}
#: Smoke test: small subsets, 2 seeds of two epochs, two VI settings, few samples.
FAST = {
    **FULL,
    "seeds": (0, 1),
    "epochs": 2,
    "train_subset": 600,
    "test_subset": 300,
    "vi_grid": ((3e-3, False), (3e-3, True)),
    "num_samples": 5,
    "val_num_samples": 2,
    "curve_every": 1,
    "curve_num_samples": 2,
    "varsel": {**FULL["varsel"], "datasets": 1, "epochs": 10},
    "clusters": {**FULL["clusters"], "per_cluster": 30, "epochs": 5, "num_samples": 5, "grid": 60},
    "digits": {**FULL["digits"], "seeds": (0,), "epochs": 2, "num_samples": 5},
}

#: part 5's rows: name -> (bw method, options); "LBBNN-LRT (paper)" has the paper code's α_p and ρ
DIGITS_METHODS: "OrderedDict[str, tuple[str, dict]]" = OrderedDict([
    ("MAP", ("map", {})),
    ("LBBNN-LRT", ("lbbnn", {})),
    ("LBBNN-LRT (paper)", ("lbbnn", {"prior_inclusion": 0.10, "init_rho": -9.0})),
])
