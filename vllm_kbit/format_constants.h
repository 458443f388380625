// The kbit format's constants, written once. The CUDA extension includes this header and
// vllm_kbit/reference.py reads it at import (it parses the `constexpr int kName = value;` lines
// below, so keep each one on one line with an integer literal).
#pragma once

namespace kbit {

constexpr int kBlockSize = 32;      // weights per quantization block (one E4M4 scale each)
constexpr int kMinBits = 2;         // supported bits per weight k: kMinBits..kMaxBits
constexpr int kMaxBits = 5;
constexpr int kE4M4Bias = 11;       // E4M4 scale byte (e, m): 2^(e - bias) * (1 + m/16); e = 0: m * 2^(1 - bias - 4)
constexpr int kE4M4Max = 31;        // the largest block scale: code 255 (e = 15, m = 15)
constexpr int kRangeMax64 = 2015;   // the largest |w| quantized at scale 1, in 64ths: kE4M4Max and the 1/64 above it that rounds to it
constexpr int kScaleSearchRadius = 8;  // scale search: codes absmax-8 .. absmax+8 around each block's absmax code
constexpr int kTileN = 64;          // runtime tile: kTileN rows (output features) ...
constexpr int kTileKB = 4;          // ... by kTileKB blocks along K
constexpr int kRotationMinBlock = 2;     // a layer's input rotation (format.md, section 9): Hadamard blocks b of
constexpr int kRotationMaxBlock = 1024;  // powers of two kRotationMinBlock..kRotationMaxBlock (one warp's registers)

static_assert(kE4M4Max * 16 == (1 << (15 - kE4M4Bias)) * 31 && kRangeMax64 == kE4M4Max * 65, "code 255's value");

// A weight's K (columns; the activations' features) holds whole blocks: the rule every check and plan asks.
constexpr bool whole_blocks(long long K) { return K > 0 && K % kBlockSize == 0; }

}  // namespace kbit
