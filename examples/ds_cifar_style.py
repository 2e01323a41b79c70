"""A DeepSpeed training loop in the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py
(argparse + add_config_arguments, init_distributed, initialize with training_data, backward/step), on synthetic
data so it runs anywhere. The only line that differs from the DeepSpeed version is the import below.

    torchrun --nproc_per_node=2 examples/ds_cifar_style.py --deepspeed_config conf.json
"""
import argparse

import torch
import torch.nn as nn

import fsdpzero as deepspeed   # the DeepSpeed version: `import deepspeed`


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def add_argument(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=1, type=int)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None, config=None):
    args = add_argument(argv)
    deepspeed.init_distributed()
    torch.manual_seed(1)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=synthetic_cifar(), config=config)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return losses


if __name__ == "__main__":
    main()
