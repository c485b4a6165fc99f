// Internal: SHA-256 over OpenSSL's EVP interface and the one lowercase-hex
// spelling of a digest (the manifest and verified loads: manifest.h; the
// object cache's piece digests; the store's keys).
#pragma once

#include <openssl/evp.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

namespace pinload::detail {

// `size` bytes of a digest as lowercase hex.
inline std::string hex_digest(const unsigned char* digest, std::size_t size) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(2 * size, '0');
  for (std::size_t i = 0; i < size; ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { reset(); }
  Sha256(Sha256&&) noexcept = default;
  Sha256& operator=(Sha256&&) noexcept = default;

  void reset() {
    if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) throw std::bad_alloc();
  }
  void update(const void* bytes, std::size_t size) {
    if (size != 0 && EVP_DigestUpdate(ctx_.get(), bytes, size) != 1) throw std::runtime_error("EVP_DigestUpdate failed");
  }
  // The digest in lowercase hex; starts over.
  std::string final_hex() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), digest, &length) != 1) throw std::runtime_error("EVP_DigestFinal_ex failed");
    reset();
    return hex_digest(digest, length);
  }

 private:
  struct Free {
    void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
  };
  std::unique_ptr<EVP_MD_CTX, Free> ctx_;
};

// The SHA-256 of `size` bytes in lowercase hex.
inline std::string sha256_hex(const void* bytes, std::size_t size) {
  Sha256 h;
  h.update(bytes, size);
  return h.final_hex();
}

}  // namespace pinload::detail
