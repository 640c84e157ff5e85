# frozen_string_literal: true

require "rails/railtie"

module NeverBlock
  module ActiveRecord
    # Rails wiring for `require "neverblock/active_record"`: Active Support's
    # isolation level is `:fiber` (Rails would otherwise apply its
    # configured level, `:thread` by default, at boot).
    class Railtie < ::Rails::Railtie
      config.active_support.isolation_level = :fiber

      initializer "neverblock.active_record" do
        NeverBlock::ActiveRecord.fiber_isolation!
      end
    end
  end
end
