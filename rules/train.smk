# pretrain: blend -> runs/{run}/checkpoints
