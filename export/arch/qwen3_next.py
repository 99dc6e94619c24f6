"""placeholder until written"""
MODEL_TYPES = ()
