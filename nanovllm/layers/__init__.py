"""Building blocks of the model: paged attention, rotary embedding, sampler."""
