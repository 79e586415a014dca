"""Generation: sampling (`sampling`) and batched, streamed generation with the workspace and price calibration
(`generate`). The incremental state itself is `prisme.model.state.DecodeState`."""
