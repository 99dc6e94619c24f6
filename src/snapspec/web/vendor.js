// The two libraries the page runs on, served by `snapspec web` from the folder that `snapspec web --install` fills
// (npm packages pinned in package-lock.json beside this file): onnxruntime-web's C++ WebGPU build, which also
// runs the wasm (CPU) backend, and Hugging Face's JavaScript tokenizers.
import * as ort from './vendor/ort/ort.webgpu.bundle.min.mjs';
import { Tokenizer } from './vendor/tokenizers/tokenizers.min.mjs';

ort.env.logLevel = 'error';

export { ort, Tokenizer };
