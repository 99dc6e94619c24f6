"""Device buffers' plumbing, in one place and without circles: cudart.py (the CUDA runtime onnxruntime loaded),
stream.py (the stream fixed-address forwards queue on, device ids, staging) and copy.py (device-to-device copies of
OrtValue byte ranges), each importing only the one before it."""
