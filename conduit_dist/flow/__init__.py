"""Flow control: policy versions and age bounds, rate limits, versioned weights."""
