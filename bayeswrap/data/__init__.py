"""Data: the bundled and image datasets, dataset shift and held-out classes, and inputs to predict.

* :mod:`~bayeswrap.data.datasets`: digits, mnist5k (bundled), Pets, Flowers-102, image folders; splits.
* :mod:`~bayeswrap.data.shift`: rotation and Gaussian-noise shift, held-out-class (OOD) splits.
* :mod:`~bayeswrap.data.inputs`: an image, a folder of images or a ``.npy`` array for ``bayeswrap predict``.
"""

from bayeswrap.data.datasets import (
    DATASETS,
    DEFAULT_ROOT,
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayDataset,
    DataDownloadError,
    DataError,
    DataNotFoundError,
    DataSplits,
    TransformSubset,
    build_transforms,
    load_data,
    random_split_indices,
)
from bayeswrap.data.inputs import load_inputs

__all__ = ["DATASETS", "DEFAULT_ROOT", "IMAGENET_MEAN", "IMAGENET_STD", "ArrayDataset", "DataDownloadError",
           "DataError", "DataNotFoundError", "DataSplits", "TransformSubset", "build_transforms", "load_data",
           "random_split_indices", "load_inputs"]
