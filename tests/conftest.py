import os
import sys

import torch

# Tests import the flat top-level modules (model.py, init.py, ...) directly.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Two cores: keep each test process on one intra-op thread so parallel helpers
# (torchrun workers) don't oversubscribe the machine.
torch.set_num_threads(1)
