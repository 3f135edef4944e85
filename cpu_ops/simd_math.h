// Vector math shared by the ops (AVX-512).
#pragma once
#include <immintrin.h>

namespace trtbuild_cpu_ops {
#if defined(__AVX512F__)
// e^x of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial for e^r (relative error
// < 2e-7), and 2^n applied by scalef: 0 below float's range; x is capped at 88 (e^88 = 1.65e38), so never inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif
}  // namespace trtbuild_cpu_ops
