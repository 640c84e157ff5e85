# frozen_string_literal: true

# For bench/refork.rb: an app whose every process builds a large cache on
# first use, what reforking shares. Each request adds BATCH entries to the
# process's cache, until it holds about NB_REFORK_CACHE_MB (default 100) MiB
# of deterministic Ruby hashes and strings (1 KiB each, a malloc'd buffer
# apart from its object: a GC writes to neither), then answers from it.
#   GET /ruby  the serving Ruby (PeerServers.check_ruby: is YJIT on in it?)
#   any other  one entry of the cache, filling it further first
ENTRY_BYTES = 1024
BATCH = 4096 # entries per request until full: about 25 requests fill 100 MiB
ENTRIES = Integer(ENV.fetch("NB_REFORK_CACHE_MB", "100")) * 1024 * 1024 / (ENTRY_BYTES + 256) # + the hash and objects
CACHE = {}
FILLING = Mutex.new

run(lambda do |env|
  if env["PATH_INFO"] == "/ruby"
    body = "#{RUBY_DESCRIPTION} yjit=#{defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? true : false}\n"
  else
    FILLING.synchronize do
      (CACHE.size...[CACHE.size + BATCH, ENTRIES].min).each do |i|
        CACHE[i] = { "id" => i, "name" => "entry #{i}", "text" => format("%08d", i) * (ENTRY_BYTES / 8) }
      end
    end
    entry = CACHE[Random.rand(CACHE.size)]
    body = "#{entry['name']}: #{entry['text'].bytesize} bytes, #{CACHE.size} cached\n"
  end
  [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
end)
