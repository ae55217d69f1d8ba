// data.cc: the data readers: gzipped IDX files (Fashion-MNIST's images and labels), dicts of
// tensors written by torch.save, and the fortune files as bytes, with the bigram and gzip references.
#include "gpipe/data.h"

#include "gpipe/check.h"
#include "gpipe/io.h"

#include <torch/torch.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <caffe2/serialize/inline_container.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace gpipe {
namespace {

std::vector<uint8_t> read_gzip(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw std::runtime_error("missing " + path +
                             ": install Fashion-MNIST with `apt-get install dataset-fashion-mnist` "
                             "(scripts/install-deps.sh does), or pass `data_dir`");
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<uint8_t> bytes;
  uint8_t buffer[1 << 16];
  int n = 0;
  while ((n = gzread(file, buffer, sizeof buffer)) > 0) bytes.insert(bytes.end(), buffer, buffer + n);
  const bool failed = n < 0;
  gzclose(file);
  if (failed) throw std::runtime_error(path + " is not a readable gzip file");
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | b[at + 3];
}

// Throws unless the pickle `p` (an archive's data.pkl) is one libtorch can unpickle without
// trusting it: every length within the bytes that follow it, every memo slot the next one or one
// already filled, and no opcode taking more from the stack than its frame (since the last MARK)
// holds. libtorch 1.13's unpickler checks none of these: it allocates what a pickle declares before
// it reads it (a memo slot of 2^31 is a vector of 32 GB) and pops past the bottom of its stack (a
// TUPLE3 over two items freed memory it had not allocated); both found by fuzz/fuzz_torch_save.
// An opcode not listed here is left to libtorch, which refuses those it does not know.
void check_pickle(std::string_view p) {
  size_t at = 0, memo = 0, depth = 0;
  std::vector<size_t> marks;  // the stack's depth at each open MARK
  auto corrupt = [](const std::string& what) { return std::runtime_error("its pickle is corrupt: " + what); };
  auto skip = [&](uint64_t bytes) {
    if (p.size() - at < bytes) throw corrupt("it declares more bytes than it holds");
    at += static_cast<size_t>(bytes);
  };
  auto take = [&](size_t bytes) {  // the next `bytes` bytes, little-endian
    skip(bytes);
    uint64_t value = 0;
    for (size_t i = 0; i < bytes; ++i) value |= uint64_t{static_cast<uint8_t>(p[at - bytes + i])} << (8 * i);
    return value;
  };
  auto line = [&] {  // a text argument, up to its newline
    const size_t end = p.find('\n', at);
    if (end == std::string::npos) throw corrupt("it declares more bytes than it holds");
    std::string text(p.substr(at, end - at));
    at = end + 1;
    return text;
  };
  // Takes `n` items off the stack, above the last MARK, and puts `pushed` on.
  auto pop = [&](size_t n, size_t pushed = 1) {
    if (depth - (marks.empty() ? 0 : marks.back()) < n) throw corrupt("an opcode takes more items than the stack holds");
    depth = depth - n + pushed;
  };
  // Takes the items down to the last MARK and the mark, and puts `pushed` on.
  auto pop_mark = [&](size_t pushed = 1) -> size_t {
    if (marks.empty()) throw corrupt("an opcode takes items down to a MARK that is not there");
    const size_t items = depth - marks.back();
    depth = marks.back() + pushed;
    marks.pop_back();
    return items;
  };
  auto put = [&](uint64_t slot) {
    pop(1);
    if (slot > memo) throw corrupt("it puts a value in memo slot " + std::to_string(slot) + " with " +
                                   std::to_string(memo) + " filled");
    if (slot == memo) ++memo;
  };
  auto get = [&](uint64_t slot) {
    if (slot >= memo) throw corrupt("it reads memo slot " + std::to_string(slot) + " with " + std::to_string(memo) +
                                    " filled");
    ++depth;
  };
  auto number = [&](const std::string& text) {
    char* end = nullptr;
    const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0') throw corrupt("a memo slot is not a number");
    return static_cast<uint64_t>(value);
  };
  while (at < p.size()) {
    const uint8_t opcode = static_cast<uint8_t>(p[at++]);
    switch (opcode) {
      case '.': pop(1, 0); return;  // STOP
      case 0x80: take(1); break;    // PROTO
      case 0x95: if (take(8) > p.size() - at) throw corrupt("a frame is longer than the pickle"); break;  // FRAME
      case 'K': case 0x82: take(1); ++depth; break;  // BININT1, EXT1
      case 'M': case 0x83: take(2); ++depth; break;  // BININT2, EXT2
      case 'J': case 0x84: take(4); ++depth; break;  // BININT, EXT4
      case 'G': take(8); ++depth; break;             // BINFLOAT
      case 'U': case 'C': case 0x8c: case 0x8a: skip(take(1)); ++depth; break;  // short strings, bytes, LONG1
      case 'T': case 'B': case 'X': case 0x8b: skip(take(4)); ++depth; break;   // strings, bytes, LONG4
      case 0x8d: case 0x8e: skip(take(8)); ++depth; break;                      // BINUNICODE8, BINBYTES8
      case 'F': case 'I': case 'L': case 'S': case 'V': case 'P': line(); ++depth; break;  // text values, PERSID
      case 'c': line(); line(); ++depth; break;  // GLOBAL: module and name
      case 'N': case 0x88: case 0x89: case '}': case ']': case ')': case 0x8f: ++depth; break;  // None, bools, empties
      case 'h': get(take(1)); break;   // BINGET
      case 'j': get(take(4)); break;   // LONG_BINGET
      case 'g': get(number(line())); break;  // GET
      case 'q': put(take(1)); break;   // BINPUT
      case 'r': put(take(4)); break;   // LONG_BINPUT
      case 'p': put(number(line())); break;  // PUT
      case 0x94: put(memo); break;     // MEMOIZE
      case '(': marks.push_back(depth); break;  // MARK
      case '0': pop(1, 0); break;      // POP
      case '1': pop_mark(0); break;    // POP_MARK
      case '2': pop(1, 2); break;      // DUP
      case 'Q': case 0x85: pop(1); break;  // BINPERSID, TUPLE1
      case 'R': case 0x86: case 0x93: case 0x81: pop(2); break;  // REDUCE, TUPLE2, STACK_GLOBAL, NEWOBJ
      case 0x87: case 0x92: pop(3); break;  // TUPLE3, NEWOBJ_EX
      case 'a': case 'b': pop(2, 1); break;  // APPEND, BUILD: onto the item below
      case 's': pop(3, 1); break;            // SETITEM
      case 'd': if (pop_mark() % 2 != 0) throw corrupt("DICT over an odd number of items"); break;
      case 'l': case 't': case 0x91: pop_mark(); break;  // LIST, TUPLE, FROZENSET
      case 'e': case 'u': case 0x90: {       // APPENDS, SETITEMS, ADDITEMS: onto the item below the MARK
        const size_t items = pop_mark(0);
        if (opcode == 'u' && items % 2 != 0) throw corrupt("SETITEMS over an odd number of items");
        pop(1, 1);
        break;
      }
      case 'o': if (pop_mark() == 0) throw corrupt("OBJ without a class"); break;
      case 'i': line(); line(); pop_mark(); break;  // INST
      default: return;
    }
  }
  throw corrupt("it has no STOP");
}

// Every storage of an archive, read from its record at the record's own size. libtorch 1.13 reads a
// storage's record and then takes the size the pickle declares for it: a shorter record (or an
// empty one, whose data is null) was read past its end (found by fuzz/fuzz_torch_save and
// fuzz/fuzz_checkpoint). Given these, the unpickler uses them, and check_inside_storage sees the
// bytes that are really there.
std::shared_ptr<torch::jit::DeserializationStorageContext> storages_from_records(
    caffe2::serialize::PyTorchStreamReader& reader) {
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  const std::string prefix = "data/";
  for (const std::string& record : reader.getAllRecords()) {
    if (record.rfind(prefix, 0) != 0 || record.size() == prefix.size()) continue;
    const std::string key = record.substr(prefix.size());
    if (storages->hasStorage(key)) throw std::runtime_error("its archive holds two records named " + record);
    auto [data, size] = reader.getRecord(record);
    storages->addStorage(key,
                         c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, false));
  }
  return storages;
}

// Throws unless every tensor in `value` lies inside its storage. An archive gives a tensor's
// storage and, apart from it, its offset, sizes and strides; libtorch 1.13 does not check that
// they agree, and reading such a tensor reads past its storage (found by fuzz/fuzz_checkpoint).
void check_inside_storage(const torch::IValue& value) {
  if (value.isTensor()) {
    const torch::Tensor& t = value.toTensor();
    if (!t.defined() || t.layout() != torch::kStrided || t.numel() == 0) return;
    __int128 last = t.storage_offset();  // the element furthest into the storage
    // A storage without a record (libtorch makes one of the pickle's size and no data when the
    // pickle gives it no elements, or fewer than none) holds nothing.
    bool inside = last >= 0 && t.has_storage() && t.storage().data() != nullptr;
    for (int64_t d = 0; d < t.dim() && inside; ++d) {
      inside = t.stride(d) >= 0;
      last += static_cast<__int128>(t.size(d) - 1) * t.stride(d);
    }
    if (!inside || (last + 1) * static_cast<__int128>(t.element_size()) > static_cast<__int128>(t.storage().nbytes()))
      throw std::runtime_error("a tensor of shape " + shape_text(t) + " reaches past the data stored for it");
  } else if (value.isTensorList()) {
    for (const torch::Tensor& t : value.toTensorVector()) check_inside_storage(t);
  } else if (value.isList()) {
    for (const torch::IValue& element : value.toListRef()) check_inside_storage(element);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) check_inside_storage(entry.value());
  } else if (value.isTuple()) {
    for (const torch::IValue& element : value.toTupleRef().elements()) check_inside_storage(element);
  }
}

}  // namespace

// An IDX file of unsigned bytes: magic 0x0000 08 <dims>, then the sizes, then the data.
torch::Tensor read_idx(const std::string& path, int dims) {
  std::vector<uint8_t> b = read_gzip(path);
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (b.size() < header || big_endian(b, 0) != (0x0800u | static_cast<uint32_t>(dims)))
    throw std::runtime_error(path + " is not an IDX file of " + std::to_string(dims) + "-d bytes");
  // The sizes' product, computed only while it can still match the data (3 sizes of up to 2^32-1
  // would overflow 64 bits).
  std::vector<int64_t> sizes;
  uint64_t count = 1;
  bool more_than_data = false;
  for (int d = 0; d < dims; ++d) {
    sizes.push_back(big_endian(b, 4 + 4 * static_cast<size_t>(d)));
    const uint64_t size = static_cast<uint64_t>(sizes.back());
    if (size != 0 && count > (b.size() - header) / size) more_than_data = true;
    count *= more_than_data ? 1 : size;
  }
  if (more_than_data || b.size() != header + count)
    throw std::runtime_error(path + " is truncated or corrupt: its header gives sizes " +
                             c10::str(c10::IntArrayRef(sizes)) + ", found " + std::to_string(b.size() - header) +
                             " data bytes");
  return torch::from_blob(b.data() + header, sizes, torch::kUInt8).clone();
}

Dataset Dataset::first(int64_t count) const {
  if (count <= 0 || count >= size()) return *this;
  return {input.narrow(0, 0, count), target.narrow(0, 0, count)};
}

Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  torch::Tensor images = read_idx(prefix + "-images-idx3-ubyte.gz", 3);
  torch::Tensor labels = read_idx(prefix + "-labels-idx1-ubyte.gz", 1);
  if (images.size(0) != labels.size(0))
    throw std::runtime_error(prefix + ": " + std::to_string(images.size(0)) + " images but " +
                             std::to_string(labels.size(0)) + " labels");
  if (limit > 0 && limit < images.size(0)) {
    images = images.narrow(0, 0, limit);
    labels = labels.narrow(0, 0, limit);
  }
  images = (images.to(torch::kFloat).div_(255.0f).sub_(kFashionMean).div_(kFashionStd)).unsqueeze(1).contiguous();
  return {images, labels.to(torch::kLong)};
}

torch::IValue load_torch_save(const std::string& bytes) {
  // torch.save (and torch::pickle_save) write a zip archive, read here as torch::jit reads one:
  // torch::pickle_load of libtorch 1.13 fails on an archive of a single tensor, and given bytes
  // that are not an archive its reader reads past their end (found by fuzz/fuzz_checkpoint).
  if (bytes.rfind("PK\x03\x04", 0) != 0)
    throw std::runtime_error("not a zip archive, the format torch.save writes");
  std::istringstream in(bytes);
  caffe2::serialize::PyTorchStreamReader reader(&in);
  if (reader.hasRecord("data.pkl")) {
    const auto [pickle, size] = reader.getRecord("data.pkl");
    check_pickle(std::string_view(static_cast<const char*>(pickle.get()), size));
  }
  const torch::IValue value =
      torch::jit::readArchiveAndTensors("data", "", "", c10::nullopt, c10::nullopt, torch::Device(torch::kCPU), reader,
                                        torch::jit::Unpickler::defaultTypeParser, storages_from_records(reader));
  check_inside_storage(value);
  return value;
}

torch::Tensor mirrored(const torch::Tensor& images, const torch::Tensor& rows, int epoch, uint64_t seed) {
  const torch::Tensor hash = rows * int64_t{2654435761} + int64_t{epoch} * int64_t{40503} +
                             static_cast<int64_t>(seed % 1000003);
  const torch::Tensor flip = hash.div(8192, "floor").remainder(2).to(torch::kBool).view({-1, 1, 1, 1});
  return torch::where(flip, images.flip({3}), images);
}

torch::Tensor add_noise(const torch::Tensor& clean, double sigma, uint64_t seed) {
  torch::Generator generator = at::detail::createCPUGenerator(seed);
  return clean + torch::randn(clean.sizes(), generator, torch::kFloat) * static_cast<float>(sigma / kFashionStd);
}

double psnr_db(double mse) {
  const double pixel_mse = mse * kFashionStd * kFashionStd;
  return 10.0 * std::log10(1.0 / pixel_mse);
}

Dataset load_tensor_data(const std::string& path) {
  const std::string save_it = "save it with torch.save({'input': X, 'target': Y}, path)";
  const std::string bytes = read_file(path);
  torch::IValue value;
  try {
    value = load_torch_save(bytes);
  } catch (const std::exception& e) {
    const std::string what = what_of(e);
    // libtorch's unpickler has neither SETITEM nor APPEND, which Python writes for a dict of one entry
    // and a list of one item, at the top or inside.
    for (const auto& [opcode, held] : {std::pair<const char*, const char*>{"0x73", "a dict of one entry"},
                                       {"0x61", "a list of one item"}})
      if (what.find(std::string("Unknown opcode for unpickling at ") + opcode) != std::string::npos)
        throw std::runtime_error(path + " holds " + held + " (at its top or inside); gpipe reads a dict of two "
                                 "tensors: " + save_it);
    // torch.save(..., _use_new_zipfile_serialization=False) begins with a pickled magic number.
    static const std::string legacy("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 14);
    if (bytes.compare(0, legacy.size(), legacy) == 0)
      throw std::runtime_error(path + " was written in torch.save's old format (_use_new_zipfile_serialization="
                               "False), which libtorch does not read; " + save_it + " again, whose default format "
                               "it reads");
    if (what.find("_get_layout") != std::string::npos || what.find("sparse") != std::string::npos)
      throw std::runtime_error(path + " holds a sparse tensor, which gpipe does not train on; save dense ones "
                               "(X.to_dense()) with torch.save({'input': X, 'target': Y}, path)");
    throw std::runtime_error(path + " is not a file written by torch.save: " + what.substr(0, 300));
  }
  if (!value.isGenericDict()) {
    auto items = [](size_t n) { return std::to_string(n) + (n == 1 ? " item" : " items"); };
    const std::string held = value.isList()     ? "a list of " + items(value.toListRef().size())
                             : value.isTuple()  ? "a tuple of " + items(value.toTupleRef().elements().size())
                             : value.isTensor() ? "one tensor"
                             : value.isNone()   ? "None"
                                                : std::string("a value of kind ") + value.tagKind();
    throw std::runtime_error(path + " holds " + held + ", not a dict; " + save_it);
  }
  auto dict = value.toGenericDict();
  auto get = [&](const char* key) {
    if (dict.contains(key) && !dict.at(key).isTensor())
      throw std::runtime_error(path + ": its '" + key + "' is " + dict.at(key).tagKind() +
                               ", not a tensor; gpipe train reads one tensor per key (a model whose first layer "
                               "takes several tensors is trained through the library, with a tuple input)");
    if (!dict.contains(key))
      throw std::runtime_error(path + " has no tensor '" + key + "'; " + save_it);
    return dict.at(key).toTensor();
  };
  torch::Tensor input = get("input"), target = get("target");
  if (input.dim() < 1 || target.dim() < 1 || input.size(0) != target.size(0))
    throw std::runtime_error(path + ": 'input' and 'target' need the same number of rows (dim 0); they have shapes " +
                             shape_text(input) + " and " + shape_text(target));
  if (input.size(0) == 0) throw std::runtime_error(path + " holds no samples ('input' has 0 rows)");
  for (const auto& [name, t] : {std::pair<const char*, torch::Tensor>{"input", input}, {"target", target}})
    if (t.is_floating_point()) {
      const torch::Tensor bad = torch::logical_not(torch::isfinite(t)).reshape({t.size(0), -1}).any(1);
      const int64_t rows = bad.sum().item<int64_t>();
      if (rows > 0)
        throw std::runtime_error(path + ": '" + name + "' holds NaN or infinite values in " + std::to_string(rows) +
                                 " rows, the first at row " + std::to_string(bad.nonzero()[0].item<int64_t>()) +
                                 "; clean the data before training");
    }
  return {input, target};
}

TextCorpus load_fortunes(const std::string& dir) {
  const std::string install = "install Debian's fortunes with `apt-get install fortunes` (scripts/install-deps.sh "
                              "does), or give the folder of the fortune files with `data_dir`";
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error))
    throw std::runtime_error("no folder " + dir + " of fortune files: " + install);
  TextCorpus corpus;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.find('.') == std::string::npos && !entry.is_symlink() && entry.is_regular_file())
      corpus.files.push_back(name);
  }
  if (error) throw std::runtime_error("cannot list " + dir + ": " + error.message());
  std::sort(corpus.files.begin(), corpus.files.end());
  if (corpus.files.empty())
    throw std::runtime_error(dir + " holds no fortune files (files without a dot in their name, fortunes separated "
                             "by lines of %): " + install);
  bool separated = false;
  std::vector<std::string> texts;
  for (const std::string& name : corpus.files) {
    std::string text = read_file(dir + "/" + name);
    // Windows line ends (CR LF) read as LF: a line "%\r" separates fortunes as "%" does.
    if (text.find("\r\n") != std::string::npos) {
      std::string lf;
      lf.reserve(text.size());
      for (size_t n = 0; n < text.size(); ++n)
        if (!(text[n] == '\r' && n + 1 < text.size() && text[n + 1] == '\n')) lf += text[n];
      text = std::move(lf);
    }
    separated = separated || text.find("\n%\n") != std::string::npos || text.rfind("%\n", 0) == 0;
    texts.push_back(std::move(text));
  }
  // The test part of a file starts at its first fortune that begins at or after 90% of it. When no
  // file has such a fortune (each a single long one, say), at the first line after 90% of each file
  // instead, or at 90% of its bytes if that tenth holds no line break.
  auto split = [&](bool by_lines) {
    corpus.train.clear();
    corpus.test.clear();
    for (const std::string& text : texts) {
      const size_t tenth = text.size() - text.size() / 10;
      const size_t mark = tenth < 3 ? std::string::npos : text.find("\n%\n", tenth - 3);
      size_t cut = mark == std::string::npos ? text.size() : mark + 3;
      if (by_lines && cut + 2 > text.size() && text.size() >= 20) {  // no fortune after the cut
        const size_t line = text.find('\n', tenth);
        cut = line != std::string::npos && line + 1 < text.size() ? line + 1 : tenth;
      }
      corpus.train += text.substr(0, cut);
      corpus.test += text.substr(cut);
    }
  };
  split(false);
  if (corpus.test.size() < 2) split(true);
  const std::string files = std::to_string(corpus.files.size()) + (corpus.files.size() == 1 ? " file" : " files");
  if (!separated)
    throw std::runtime_error(dir + " holds " + files + " of text, but no line \"%\" in any: fortune files separate "
                             "their fortunes by lines holding only %, and the test text is the fortunes in the last "
                             "tenth of each file; separate the texts so, or " + install);
  if (corpus.train.size() < 2 || corpus.test.size() < 2)
    throw std::runtime_error(dir + " holds too little text: " + std::to_string(corpus.train.size()) +
                             " bytes to train on and " + std::to_string(corpus.test.size()) + " to test on (the "
                             "last tenth of each file of at least 20 bytes is for testing); give a folder with more "
                             "fortunes, or " + install);
  return corpus;
}

Dataset byte_windows(const std::string& text, int64_t length) {
  GPIPE_CHECK(length >= 1, "a window needs at least 1 byte (got ", length, ")");
  const int64_t n = (static_cast<int64_t>(text.size()) - 1) / length;
  GPIPE_CHECK(n >= 1, "a text of ", text.size(), " bytes holds no window of ", length, " bytes and the byte after it");
  // One int64 copy of the bytes the windows use; input and target are two views of it (the target
  // one byte on), so the samples take 8 bytes per byte of text, not a copy per window.
  const torch::Tensor bytes =
      torch::from_blob(const_cast<char*>(text.data()), {n * length + 1}, torch::kUInt8).to(torch::kLong);
  return {bytes.narrow(0, 0, n * length).view({n, length}), bytes.narrow(0, 1, n * length).view({n, length})};
}

double bigram_bits_per_byte(const std::string& train, const std::string& test) {
  GPIPE_CHECK(test.size() >= 2, "the bigram model needs a test text of at least 2 bytes");
  std::vector<double> pairs(256 * 256, 0.0);
  std::array<double, 256> firsts{};
  for (size_t n = 0; n + 1 < train.size(); ++n) {
    const auto a = static_cast<uint8_t>(train[n]), b = static_cast<uint8_t>(train[n + 1]);
    pairs[a * 256u + b] += 1;
    firsts[a] += 1;
  }
  double bits = 0;
  for (size_t n = 0; n + 1 < test.size(); ++n) {
    const auto a = static_cast<uint8_t>(test[n]), b = static_cast<uint8_t>(test[n + 1]);
    bits -= std::log2((pairs[a * 256u + b] + 1) / (firsts[a] + 256));
  }
  return bits / static_cast<double>(test.size() - 1);
}

double gzip_bits_per_byte(const std::string& text) {
  GPIPE_CHECK(!text.empty(), "gzip's bits per byte need a text of at least 1 byte");
  uLongf size = compressBound(static_cast<uLong>(text.size()));
  std::vector<Bytef> out(size);
  const int status = compress2(out.data(), &size, reinterpret_cast<const Bytef*>(text.data()),
                               static_cast<uLong>(text.size()), 9);
  if (status != Z_OK) throw std::runtime_error("zlib failed to compress the test text (error " + std::to_string(status) + ")");
  return 8.0 * static_cast<double>(size) / static_cast<double>(text.size());
}

}  // namespace gpipe
