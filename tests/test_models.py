import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from src.models.lenet import LeNet
from src.models.resnet import resnet18


def conv_params(c_in: int, c_out: int, k: int, bias: bool = True) -> int:
    return c_in * c_out * k * k + (c_out if bias else 0)


def test_lenet_shapes_and_parameter_count():
    net = LeNet()
    assert net(torch.zeros(5, 1, 28, 28)).shape == (5, 10)
    # 28 -3x3-> 26 -pool-> 13 -5x5-> 9 -pool-> 4: 50 x 4 x 4 = 800 features into the first linear layer.
    expected = conv_params(1, 20, 3) + conv_params(20, 50, 5) + (800 * 128 + 128) + (128 * 10 + 10)
    assert sum(p.numel() for p in net.parameters()) == expected


def test_lenet_layers_follow_the_book():
    convs = [m for m in LeNet() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(20, (3, 3)), (50, (5, 5))]
    assert sum(isinstance(m, nn.AvgPool2d) for m in LeNet()) == 2


def test_lenet_init_is_normal_with_std_001():
    torch.manual_seed(0)
    weights = torch.cat([m.weight.flatten() for m in LeNet() if isinstance(m, (nn.Conv2d, nn.Linear))])
    assert weights.std().item() == pytest.approx(0.01, rel=0.05)
    assert abs(weights.mean().item()) < 1e-3
    assert all((m.bias == 0).all() for m in LeNet() if isinstance(m, (nn.Conv2d, nn.Linear)))


def test_resnet18_shapes_stem_and_parameter_count():
    net = resnet18()
    assert net(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1) and net.conv1.in_channels == 1
    assert isinstance(net.bn1, nn.BatchNorm2d) and isinstance(net.maxpool, nn.Identity)
    stages = [net.layer1, net.layer2, net.layer3, net.layer4]
    assert [len(s) for s in stages] == [2, 2, 2, 2]
    assert all(isinstance(block, BasicBlock) for s in stages for block in s)
    assert [s[-1].conv2.out_channels for s in stages] == [64, 128, 256, 512]

    def bn(c: int) -> int:
        return 2 * c

    def block(c_in: int, c_out: int) -> int:
        shortcut = conv_params(c_in, c_out, 1, bias=False) + bn(c_out) if c_in != c_out else 0
        return conv_params(c_in, c_out, 3, False) + bn(c_out) + conv_params(c_out, c_out, 3, False) + bn(c_out) + shortcut

    expected = conv_params(1, 64, 3, bias=False) + bn(64) + 512 * 10 + 10
    for c_in, c_out in ((64, 64), (64, 128), (128, 256), (256, 512)):
        expected += block(c_in, c_out) + block(c_out, c_out)
    assert sum(p.numel() for p in net.parameters()) == expected


def test_resnet18_keeps_spatial_size_until_the_second_stage():
    net = resnet18()
    x = net.relu(net.bn1(net.conv1(torch.zeros(1, 1, 28, 28))))
    assert net.layer1(net.maxpool(x)).shape[-2:] == (28, 28)


@pytest.mark.parametrize("build", [LeNet, resnet18])
def test_networks_take_the_input_channels_and_classes_of_the_data(build):
    net = build(num_classes=7, in_channels=3)
    assert net(torch.zeros(2, 3, 28, 28)).shape == (2, 7)
    with pytest.raises(RuntimeError, match="channels"):
        net(torch.zeros(2, 1, 28, 28))


def test_lenet_options_add_batch_norm_max_pool_and_kaiming_init():
    torch.manual_seed(0)
    net = LeNet(batch_norm=True, pool="max", init="kaiming")
    assert net(torch.zeros(5, 1, 28, 28)).shape == (5, 10)
    assert [type(m) for m in net if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d))] == [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]
    assert sum(isinstance(m, nn.MaxPool2d) for m in net) == 2 and not any(isinstance(m, nn.AvgPool2d) for m in net)
    first = next(m for m in net if isinstance(m, nn.Conv2d))
    assert first.weight.std().item() == pytest.approx((2 / 9) ** 0.5, rel=0.2)  # He: sqrt(2 / fan_in), fan_in 1 x 3 x 3


@pytest.mark.parametrize("option", [{"pool": "min"}, {"init": "xavier"}])
def test_lenet_refuses_an_unknown_option(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        LeNet(**option)
