/* C API of the BaGuaLu planner (libbgl_planner.so): the embedded planner for frameworks that
 * cannot link C++ (the PyTorch integration calls it through ctypes). Documents are JSON in the
 * formats of docs/planner.md; every call is safe to make with bad input: it fails with NULL or a
 * negative code and bgl_planner_last_error() says what was wrong. A handle is not thread-safe:
 * serialise calls on one handle. */
#ifndef BGL_PLANNER_H_
#define BGL_PLANNER_H_

#include <stdint.h>

#if defined(__GNUC__)
#define BGL_PLANNER_API __attribute__((visibility("default")))
#else
#define BGL_PLANNER_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* One stage's planner (one GPU, one training process). */
typedef struct bgl_planner bgl_planner;

/* Creates a planner. model_json: a model document (like models/tiny-moe.json, may include a
 * "layer_graph"). options_json: NULL or an object with optional keys "capacity_bytes",
 * "pipeline_rank", "gpu" (profile name), "calibration" (object), "issue_policy" ("dual-batch"
 * (default), "lockstep" or "serial"; "dual_batch": false is "serial"), "allow_offload",
 * "allow_fp8", "allow_recompute" (bools), and the plan-cache steps "budget_step_bytes" (default 64
 * MiB; small models want less), "load_bucket" (0.05) and "schedule_load_class" (0.25), and
 * "anytime_min_ops" (64; 0: off): chunks of at least that many operators answer a plan-cache miss
 * with a quick first answer and refine it on a background thread (the plan's "first_answer" and
 * "refined" say which); "warm_up" (false): from the first planned point on, the full search
 * plans in the background the keys the run will meet at loads 1 to "warm_spike_bound" (3.0; a
 * load factor in [1, 64]), at most "warm_max_keys" (0: half the plan cache) of them, on a
 * worker thread at nice "warm_nice" (19; 0-19) (the plan's "warm" says a warm-up plan served
 * it); the first answers' refinements run at nice "refine_nice" (0; 0-19; the package asks for 19);
 * "gate_search_share" (0.25; in [0, 1]; 0: always the full search): the share of the exposed
 * overhead it could remove that the downgrade after the gate may spend searching (docs/planner.md,
 * "The downgrade's search has a price"). An unknown key is an error naming it.
 * NULL on error. */
BGL_PLANNER_API bgl_planner* bgl_planner_create(const char* model_json, const char* options_json);
BGL_PLANNER_API void bgl_planner_destroy(bgl_planner* planner);

/* The hardware profile a calibration document (docs/planner.md, "Calibration") makes on top of
 * the profile `gpu` (NULL: the document's own "gpu", else "h200"), as a calibration document
 * with every field: what a planner created with {"gpu": gpu, "calibration": doc} plans with.
 * NULL when the document is bad; the message names the field (unknown keys and values outside
 * their range are errors). Free with bgl_planner_free_string. */
BGL_PLANNER_API char* bgl_planner_calibrated_profile(const char* calibration_json, const char* gpu);

/* Describes the stage: operators (name, kind, layer, saved tensors), tensors, activation
 * capacity, M0, micro-batches, chunks, the step schedule. Free with bgl_planner_free_string. */
BGL_PLANNER_API char* bgl_planner_describe(bgl_planner* planner);

/* The step order of one pipeline rank, without a model: a JSON array of {"forward": bool,
 * "micro_batch", "chunk", "phase"} (1F1B for chunks = 1, Megatron's interleaved 1F1B above).
 * NULL when the arguments are invalid (the message names which). Free with
 * bgl_planner_free_string. */
BGL_PLANNER_API char* bgl_planner_schedule(int pipeline_stages, int pipeline_rank,
                                           int micro_batches, int chunks);

/* Plans a scheduling point: {"phase": "warmup"|"steady"|"cooldown" (optional),
 * "forward_micro_batch": int (optional), "forward_chunk": int, "backward_micro_batch": int
 * (optional), "backward_chunk": int, "load_factor": number, "bytes_in_use": int (optional)}.
 * Returns the plan as JSON (free with bgl_planner_free_string) or NULL. */
BGL_PLANNER_API char* bgl_planner_plan(bgl_planner* planner, const char* point_json);

/* Deferred planning after the MoE gate of `gate_layer` (within the chunk) ran with load r: a
 * revised plan ("deferred": true) where the plan no longer fits, else the plan unrevised
 * ("deferred": false, no issue order: keep the one in effect). */
BGL_PLANNER_API char* bgl_planner_plan_after_gate(bgl_planner* planner, int micro_batch, int chunk,
                                                  int gate_layer, double observed_load_factor);

/* What the forward of (micro_batch, chunk) really retained. 0 on success, -1 on error. */
BGL_PLANNER_API int bgl_planner_report(bgl_planner* planner, int micro_batch, int chunk,
                                       int64_t actual_bytes);

/* Starts the warm-up now (a planner created with "warm_up": true starts it at its first plan
 * otherwise): its worker plans the keys the run will meet under a host limit of
 * `host_limit_bytes` (-1: none) and a share in (0, 1] of the link's bandwidth. A second call does
 * nothing. 0 on success, -1 on error (no warm-up configured, a bad share). */
BGL_PLANNER_API int bgl_planner_warm_up(bgl_planner* planner, int64_t host_limit_bytes,
                                        double bandwidth_share);

/* Forgets live micro-batches at an iteration boundary (caches are kept). */
BGL_PLANNER_API void bgl_planner_reset_iteration(bgl_planner* planner);

/* The planner's counters as JSON: the plan cache's "cache_hits", "cache_misses",
 * "cache_evictions", "cache_entries"; the anytime path's "first_answers", "refined",
 * "refine_cpu_s"; the warm-up's "warm_keys" (cache entries holding its plans now),
 * "warm_enumerated", "warm_submitted", "warm_done", "warm_hits", "warm_rounds", "warm_complete",
 * "warm_cpu_s" (the worker thread's CPU seconds); the downgrades after the gate's
 * "gate_searches" (those that ran the search), "gate_searches_cut" (those its price cut or
 * skipped) and "gate_search_s" (the searches' wall seconds). NULL on error. Free with
 * bgl_planner_free_string. */
BGL_PLANNER_API char* bgl_planner_stats(bgl_planner* planner);

/* The last error of the calling thread ("" if none). Valid until the thread's next call. */
BGL_PLANNER_API const char* bgl_planner_last_error(void);
BGL_PLANNER_API void bgl_planner_free_string(char* text);

#ifdef __cplusplus
}
#endif

#endif /* BGL_PLANNER_H_ */
