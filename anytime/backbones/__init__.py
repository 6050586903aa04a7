"""The backbone zoo: CIFAR-sized models with a stage contract, and torchvision classifiers as ``tv:NAME``.

Importing this package registers the zoo (one file per family, in the order ``anytime models`` lists).
"""

# isort: off
from anytime.backbones import lenet, vgg, resnet, preact_resnet, resnext, mobilenetv2, cifar_resnet, fastcnn, msdnet  # noqa: F401
from anytime.backbones import text, ngram, hf  # noqa: F401

# isort: on
from anytime.backbones.base import StagedBackbone, StageInfo, example_input, takes_tokens
from anytime.backbones.registry import (
    ModelCost,
    ModelSpec,
    create_model,
    get_spec,
    list_models,
    model_cost,
    model_costs,
    model_modality,
    register_model,
)

__all__ = [
    "ModelCost", "ModelSpec", "StageInfo", "StagedBackbone", "create_model", "example_input", "get_spec", "list_models",
    "model_cost", "model_costs", "model_modality", "register_model", "takes_tokens",
]  # fmt: skip
