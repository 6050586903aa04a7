"""The backbone zoo: CIFAR-sized models with a stage contract, and torchvision classifiers as ``tv:NAME``.

Importing this package registers the zoo (one file per family, in the order ``anytime models`` lists).
"""

# isort: off
from anytime.backbones import lenet, vgg, resnet, preact_resnet, resnext, mobilenetv2, cifar_resnet, fastcnn  # noqa: F401
# isort: on
from anytime.backbones.base import StageInfo, StagedBackbone
from anytime.backbones.registry import (
    ModelCost,
    ModelSpec,
    create_model,
    get_spec,
    list_models,
    model_cost,
    model_costs,
    register_model,
)

__all__ = [
    "ModelCost", "ModelSpec", "StageInfo", "StagedBackbone", "create_model", "get_spec", "list_models", "model_cost",
    "model_costs", "register_model",
]  # fmt: skip
