// Checks of a vector build's kept first level (sampling_cpu_search.h), included by
// test_sampling_cpu.cpp inside each vector build's parts namespace, after the bodies.

// The search with a hint: 0 the ops' (the key of e), 1 none, 2 one that keeps too little.
__attribute__((noinline)) bool search_with_hint(Scratch& scratch, int64_t vocab, float top_p,
                                                float x_max, int hint, uint32_t& key) {
  const auto floor_key = [x_max, hint](float e) {
    return hint == 0 ? sort_key(x_max + std::log(e)) : hint == 1 ? 0u : sort_key(x_max);
  };
  return histogram_search(scratch, vocab, 0.0, top_p, floor_key, key);  // (small rows too)
}

// keep_from_key keeps exactly the tokens with key >= key_floor, in order, with their ids
// (buffers of exactly vocab: the sanitiser sees any store past them), and the first level
// over them has the full level's bins from key_floor's up, bit for bit, and nothing below.
__attribute__((noinline)) bool kept_level_is_the_full_levels(const Scratch& full, int64_t vocab,
                                                             uint32_t key_floor) {
  std::vector<uint32_t> keys(vocab), index(vocab);
  std::vector<float> weights(vocab);
  const int64_t kept = keep_from_key(full.keys.data(), full.weights.data(), vocab, key_floor,
                                     keys.data(), weights.data(), index.data());
  bool ok = true;
  int64_t want = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (full.keys[i] < key_floor) continue;
    ok = ok && want < kept && keys[want] == full.keys[i] &&
         float_bits(weights[want]) == float_bits(full.weights[i]) &&
         index[want] == static_cast<uint32_t>(i);
    ++want;
  }
  ok = ok && kept == want;
  Scratch restricted, all;
  double above = 0.0;
  first_level(restricted, keys.data(), weights.data(), kept, index.data(), 0.0, above);
  first_level(all, full.keys.data(), full.weights.data(), vocab, nullptr, 0.0, above);
  const uint32_t floor_bin = key_floor >> 21;
  for (uint32_t bin = 0; bin < 2048; ++bin) {
    for (const uint32_t part : {0u, 2048u}) {  // the merged sums and the odd ids' histogram
      const double got = restricted.hist[part + bin], expected = all.hist[part + bin];
      ok = ok && (bin >= floor_bin ? std::memcmp(&got, &expected, 8) == 0 : got == 0.0);
    }
  }
  return ok;
}
