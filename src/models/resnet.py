"""ResNet-18 for 28x28 grayscale images, built from torchvision's ResNet."""

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


def resnet18(num_classes: int = 10, in_channels: int = 1) -> ResNet:
    """torchvision's ResNet-18 with the book's small-image stem.

    A 7x7 stride-2 stem and a max-pool would shrink a 28x28 image to 7x7 before the
    first residual stage, so the stem becomes a 3x3 stride-1 convolution (with
    BatchNorm and ReLU, which torchvision keeps) and the max-pool is removed.
    """
    net = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net
