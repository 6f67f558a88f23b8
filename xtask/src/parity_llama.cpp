// Reference runner for `cargo xtask parity`: llama.cpp's tokenization, greedy continuation and
// final logits on a GGUF file. Written by xtask into the cache directory and compiled against the
// pinned libllama there.
//
//   parity-llama tokenize MODEL TEXT...               -> {"tokens":[[ids],...]}
//   parity-llama generate MODEL THREADS N LOGITS PROMPT [UBATCH] -> {"prompt":[ids],"ids":[ids]}
// UBATCH (default 256) is the number of prompt tokens per llama_decode call.
// The logits that chose the last generated token are written to LOGITS (f32 little-endian).
//
// Context: llama.cpp's defaults (F16 K and V cache, repacked weights), with flash attention set
// explicitly ON. That is what the default `flash_attn_type = AUTO` resolves to on the CPU
// backend (llama_context::resolve_fused_ops finds FLASH_ATTN_EXT supported on the layer's
// device), what llama-bench measures (its default is also AUTO) and so what a user of llama.cpp
// gets; setting it explicitly keeps the reference from changing if AUTO's resolution changes.
// The engine reproduces this path (engine/src/attention.rs).
// One exception to llama.cpp's defaults: swa_full = false. llama_context_default_params() keeps a
// full-context cache for sliding-window layers (swa_full = true), but llama-server, llama-cli
// (common_params) and llama-bench all turn that off and keep those layers in a ring of
// pad(n_swa + n_ubatch, 256) cells, reused from cell 0 once full; that ring is what users run and
// what the engine implements (engine/src/attention.rs, LayerKv). With the full-size cache, a
// prompt past 512 tokens visits the cells in another order and splits another KV view across
// threads, and the logits differ.
//
// Debugging aid: with PARITY_DUMP=DIR, every named tensor of every llama_decode call is written
// as f32 to DIR/step-NNNN/NAME.bin (the engine writes the same layout with ENGINE_DUMP_DIR).
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

// PARITY_DUMP (see the header): the eval callback copies each named F32/F16 tensor out.
static int g_step = 0;
static const char * g_dump = nullptr;

static bool dump_cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return t->name[0] != 0;
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16) return true;
    const int64_t n = ggml_nelements(t);
    std::vector<char> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<float> out;
    out.reserve(n);
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
        const size_t off = i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3];
        if (off >= raw.size()) continue;
        out.push_back(t->type == GGML_TYPE_F32 ? *(const float *)(raw.data() + off)
                                               : ggml_fp16_to_fp32(*(const ggml_fp16_t *)(raw.data() + off)));
    }
    char dir[4096], path[4096 + 128];
    snprintf(dir, sizeof dir, "%s/step-%04d", g_dump, g_step);
    std::string mk = std::string("mkdir -p '") + dir + "'";
    static int made = -1;
    if (made != g_step) { if (system(mk.c_str()) != 0) return true; made = g_step; }
    snprintf(path, sizeof path, "%s/%s.bin", dir, t->name);
    FILE * f = fopen(path, "wb");
    if (f) { fwrite(out.data(), sizeof(float), out.size(), f); fclose(f); }
    return true;
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text) {
    std::vector<llama_token> out(text.size() + 16);
    int n = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                           /*add_special*/ true, /*parse_special*/ true);
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), out.data(), (int32_t) out.size(), true, true);
    }
    out.resize(n < 0 ? 0 : n);
    return out;
}

static void print_ids(const std::vector<llama_token> & ids) {
    printf("[");
    for (size_t i = 0; i < ids.size(); i++) printf(i ? ",%d" : "%d", ids[i]);
    printf("]");
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s tokenize MODEL TEXT... | generate MODEL THREADS N LOGITS PROMPT\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    const std::string mode = argv[1];
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[2], mp);
    if (!model) { fprintf(stderr, "llama.cpp could not load %s\n", argv[2]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    if (mode == "tokenize") {
        printf("{\"tokens\":[");
        for (int i = 3; i < argc; i++) {
            if (i > 3) printf(",");
            print_ids(tokenize(vocab, argv[i]));
        }
        printf("]}\n");
        llama_model_free(model);
        return 0;
    }
    if (mode != "generate" || (argc != 7 && argc != 8)) { fprintf(stderr, "bad arguments\n"); return 2; }
    const int ubatch = argc == 8 ? atoi(argv[7]) : 256;
    const int threads = atoi(argv[3]);
    const int n_gen = atoi(argv[4]);
    const char * logits_path = argv[5];
    std::vector<llama_token> prompt = tokenize(vocab, argv[6]);
    if (prompt.empty()) { fprintf(stderr, "empty prompt\n"); return 1; }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (prompt.size() + n_gen + 8);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = 256;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.swa_full = false;
    cp.no_perf = true;
    g_dump = getenv("PARITY_DUMP");
    if (g_dump) { cp.cb_eval = dump_cb; cp.cb_eval_user_data = nullptr; }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama_init_from_model failed\n"); return 1; }

    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> ids;
    std::vector<float> last(n_vocab);
    for (size_t i = 0; i < prompt.size(); i += ubatch) {
        const int32_t n = (int32_t) std::min(prompt.size() - i, (size_t) ubatch);
        if (llama_decode(ctx, llama_batch_get_one(prompt.data() + i, n))) {
            fprintf(stderr, "llama_decode failed on the prompt\n"); return 1;
        }
        g_step++;
    }
    for (int i = 0; i < n_gen; i++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int j = 1; j < n_vocab; j++) if (logits[j] > logits[best]) best = j;
        memcpy(last.data(), logits, sizeof(float) * n_vocab);
        ids.push_back(best);
        if (i + 1 == n_gen) break;
        llama_token t = best;
        if (llama_decode(ctx, llama_batch_get_one(&t, 1))) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        g_step++;
    }
    FILE * f = fopen(logits_path, "wb");
    if (!f || fwrite(last.data(), sizeof(float), n_vocab, f) != (size_t) n_vocab) {
        fprintf(stderr, "cannot write %s\n", logits_path); return 1;
    }
    fclose(f);
    printf("{\"prompt\":");
    print_ids(prompt);
    printf(",\"ids\":");
    print_ids(ids);
    printf("}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
