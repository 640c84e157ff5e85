# frozen_string_literal: true

# The upstream of bench/debounce.rb: GET /config waits DELAY seconds (env
# NB_BENCH_DELAY, default 0.2) and answers a config document; every request
# to it is counted. GET /count answers the count and resets it. GET /most
# answers the most requests it served at once (a limit's test counts them
# here, at the upstream) and resets that.
#
# With NB_BENCH_DEBOUNCE=1 the app is wrapped in NeverBlock::Debouncer (the
# "middleware" variant: the count is then the calls that got past it).
delay = Float(ENV.fetch("NB_BENCH_DELAY", "0.2"))
count = 0
serving = 0
most = 0
config = lambda do |env|
  return [200, { "content-type" => "text/plain" }, ["#{count.tap { count = 0 }}\n"]] if env["PATH_INFO"] == "/count"
  return [200, { "content-type" => "text/plain" }, ["#{most.tap { most = serving }}\n"]] if env["PATH_INFO"] == "/most"

  count += 1
  most = [most, serving += 1].max
  begin
    sleep(delay)
  ensure
    serving -= 1
  end
  body = %({"feature_flags":{"new_checkout":true},"replicas":3,"generated_at":"#{Time.now.utc}"}\n)
  [200, { "content-type" => "application/json", "content-length" => body.bytesize.to_s }, [body]]
end

if ENV["NB_BENCH_DEBOUNCE"] == "1"
  require "neverblock/debouncer"
  counted = config
  debounced = NeverBlock::Debouncer.new(counted)
  config = ->(env) { env["PATH_INFO"] == "/count" ? counted.call(env) : debounced.call(env) }
end

run config
