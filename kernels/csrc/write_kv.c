/*
 * Writes a step's new keys and values into their slots of the paged KV cache, float32, for the CPU backend.
 *
 * torch's index_copy_ takes the same arguments, but the keys and values are strided views of the fused qkv
 * projection's output (feature-major at decode sizes, see kernels/cpu_backend.py), which sends it down a
 * generic element-by-element path: a few hundred microseconds a layer at a 64-token decode step, for 100 KB.
 * This is a plain copy, on the calling thread: at decode sizes handing work to a second one costs more.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <stdint.h>
#include <string.h>

/*
 * k_cache/v_cache hold `num_slots` rows of `features` floats (num_kv_heads * head_dim). key/value are
 * [tokens, features] with the given token and feature strides (one of them 1). Token t goes to row
 * slots[t]; a negative slot (padding) is skipped. Returns 0, or -1 (nothing written) if a slot is past
 * the cache.
 */
int write_kv_f32(float *k_cache, float *v_cache, const float *key, const float *value, const int64_t *slots,
                 int64_t tokens, int64_t features, int64_t token_stride, int64_t feature_stride, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        float *k_row = k_cache + slot * features, *v_row = v_cache + slot * features;
        const float *k = key + t * token_stride, *v = value + t * token_stride;
        if (feature_stride == 1) {
            memcpy(k_row, k, sizeof(float) * (size_t)features);
            memcpy(v_row, v, sizeof(float) * (size_t)features);
        } else {
            for (int64_t f = 0; f < features; ++f) k_row[f] = k[f * feature_stride];
            for (int64_t f = 0; f < features; ++f) v_row[f] = v[f * feature_stride];
        }
    }
    return 0;
}
