"""The data layer: datasets of chats or token ids into shape buckets, prompt sets, regeneration by the target, and
the tiny target and chats the demo and the tests use. Above the model layer (masks, the target), below the run."""
