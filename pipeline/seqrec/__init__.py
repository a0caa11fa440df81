"""DPFormer's task: differentially private next-item prediction (data, models, clipping, train,
evaluate, plot), independent of the NoisyHead code; it shares pipeline.privacy, tracking, sweeps."""
