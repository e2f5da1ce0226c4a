"""The pretraining loop: the Trainer that builds the run's pieces in order and calls them once per step."""
